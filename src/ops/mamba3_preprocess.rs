//! `mamba3_preprocess_fwd` / `mamba3_preprocess_bwd` (spec/mamba.md §4.2, §4.7, §5.1; seed 003).
//!
//! One projected row is `[z | x | B (bc_rows×state) | C (bc_rows×state) | dd_dt | dd_a | trap | angles]`.
//! Forward: bh/ch = RMSNorm(B/C)·w, dt = clamp(softplus(dd_dt + dt_bias), dt_min, dt_max),
//! adt = −max(heavy_tail(dd_a), a_floor)·dt. Backward writes every column of `dprojected`; the
//! cross-row sums (ddt_bias, the norm-weight gradients) go through `column_sum` in a fixed order.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, NO_BUFFER};
use crate::kernels;
use crate::ops::math::{heavy_tail, heavy_tail_derivative, softplus, softplus_derivative};
use crate::ops::reduce::{column_sums, Partials};
use crate::ops::{optional_slot, slot, ExampleSize, GpuTensors, OpDef, Recorded, ScalarCheck, ShapeCheck};
use crate::push_constants;
use crate::random::Rng;
use crate::tensor::{Scalars, Tensor, TensorMap};

push_constants! {
    /// Push constants of `mamba3_preprocess.slang` (both entry points).
    pub struct PreprocessPush {
        projected: u32,
        dt_bias: u32,
        b_norm_weight: u32,
        c_norm_weight: u32,
        bh: u32,
        ch: u32,
        dt: u32,
        adt: u32,
        dz: u32,
        dx: u32,
        dbh: u32,
        dch: u32,
        ddt: u32,
        dadt: u32,
        dtrap: u32,
        dangles: u32,
        dprojected: u32,
        b_weight_partial: u32,
        c_weight_partial: u32,
        rows: u32,
        inner: u32,
        state: u32,
        heads: u32,
        bc_rows: u32,
        rope_angles: u32,
        eps: f32,
        dt_min: f32,
        dt_max: f32,
        a_floor: f32,
    }
}
const _: () = assert!(std::mem::size_of::<PreprocessPush>() == kernels::mamba3_preprocess::PUSH_CONSTANT_BYTES);

/// Rows per workgroup: 8 teams of 32 lanes, one row each.
const ROWS_PER_WORKGROUP: usize = 8;

/// Validated sizes and scalars of one call.
#[derive(Clone, Debug)]
pub struct PreprocessProblem {
    pub rows: usize,
    pub inner: usize,
    pub state: usize,
    pub heads: usize,
    pub bc_rows: usize,
    pub rope_angles: usize,
    pub has_b_weight: bool,
    pub has_c_weight: bool,
    pub eps: f32,
    pub dt_min: f32,
    pub dt_max: f32,
    pub a_floor: f32,
}

impl PreprocessProblem {
    pub fn width(&self) -> usize {
        2 * self.inner + 2 * self.bc_rows * self.state + 3 * self.heads + self.rope_angles
    }
    fn b_offset(&self) -> usize {
        2 * self.inner
    }
    fn c_offset(&self) -> usize {
        self.b_offset() + self.bc_rows * self.state
    }
    fn dd_dt_offset(&self) -> usize {
        self.c_offset() + self.bc_rows * self.state
    }
    fn dd_a_offset(&self) -> usize {
        self.dd_dt_offset() + self.heads
    }
    fn trap_offset(&self) -> usize {
        self.dd_a_offset() + self.heads
    }
    fn angle_offset(&self) -> usize {
        self.trap_offset() + self.heads
    }
}

fn check_common(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<PreprocessProblem> {
    let positive = |name: &str| -> Result<usize> {
        let value = scalars.u32_required(name)?;
        if value == 0 {
            return Err(scalars.error(name, "must be at least 1"));
        }
        Ok(value as usize)
    };
    let inner = positive("inner")?;
    let state = positive("state")?;
    let heads = positive("heads")?;
    let bc_rows = positive("bc_rows")?;
    let rope_angles = positive("rope_angles")?;
    let eps = scalars.finite_f32_or("eps", 1e-5)?;
    let dt_min = scalars.finite_f32_or("dt_min", 0.0)?;
    let dt_max = scalars.f32_or("dt_max", f32::INFINITY)?;
    let a_floor = scalars.finite_f32_or("a_floor", 1e-4)?;
    if eps < 0.0 {
        return Err(scalars.error("eps", format!("must be >= 0, got {eps}")));
    }
    if dt_min < 0.0 {
        return Err(scalars.error("dt_min", format!("must be >= 0, got {dt_min}")));
    }
    if dt_max.is_nan() || dt_max < dt_min {
        return Err(scalars.error("dt_max", format!("must be >= dt_min ({dt_min}), got {dt_max}")));
    }
    if a_floor < 0.0 {
        return Err(scalars.error("a_floor", format!("must be >= 0, got {a_floor}")));
    }
    let width = 2 * inner + 2 * bc_rows * state + 3 * heads + rope_angles;
    let projected = shapes.required("projected", &["rows", "width"])?;
    let rows = projected[0];
    if projected[1] != width {
        return Err(shapes.error(
            "projected",
            format!(
                "expected width {width} = 2·inner + 2·bc_rows·state + 3·heads + rope_angles \
                 (inner={inner}, bc_rows={bc_rows}, state={state}, heads={heads}, rope_angles={rope_angles}), got shape {projected:?}"
            ),
        ));
    }
    shapes.exact("dt_bias", &[("heads", heads)])?;
    let has_b_weight = shapes.exact_optional("b_norm_weight", &[("state", state)])?;
    let has_c_weight = shapes.exact_optional("c_norm_weight", &[("state", state)])?;
    Ok(PreprocessProblem {
        rows,
        inner,
        state,
        heads,
        bc_rows,
        rope_angles,
        has_b_weight,
        has_c_weight,
        eps,
        dt_min,
        dt_max,
        a_floor,
    })
}

fn base_push(p: &PreprocessProblem, inputs: &GpuTensors, op: &str) -> Result<PreprocessPush> {
    Ok(PreprocessPush {
        projected: slot(inputs, op, "projected")?,
        dt_bias: slot(inputs, op, "dt_bias")?,
        b_norm_weight: optional_slot(inputs, "b_norm_weight"),
        c_norm_weight: optional_slot(inputs, "c_norm_weight"),
        bh: NO_BUFFER,
        ch: NO_BUFFER,
        dt: NO_BUFFER,
        adt: NO_BUFFER,
        dz: optional_slot(inputs, "dz"),
        dx: optional_slot(inputs, "dx"),
        dbh: optional_slot(inputs, "dbh"),
        dch: optional_slot(inputs, "dch"),
        ddt: optional_slot(inputs, "ddt"),
        dadt: optional_slot(inputs, "dadt"),
        dtrap: optional_slot(inputs, "dtrap"),
        dangles: optional_slot(inputs, "dangles"),
        dprojected: NO_BUFFER,
        b_weight_partial: NO_BUFFER,
        c_weight_partial: NO_BUFFER,
        rows: p.rows as u32,
        inner: p.inner as u32,
        state: p.state as u32,
        heads: p.heads as u32,
        bc_rows: p.bc_rows as u32,
        rope_angles: p.rope_angles as u32,
        eps: p.eps,
        dt_min: p.dt_min,
        dt_max: p.dt_max,
        a_floor: p.a_floor,
    })
}

/// dt and the decay rate A of one (row, head), in f64.
fn dt_and_a(p: &PreprocessProblem, raw_dt: f64, raw_a: f64) -> (f64, f64, f64) {
    let softplus_value = softplus(raw_dt);
    let dt = softplus_value.clamp(f64::from(p.dt_min), f64::from(p.dt_max));
    let a = -heavy_tail(raw_a).max(f64::from(p.a_floor));
    (softplus_value, dt, a)
}

fn inverse_rms(values: &[f64], eps: f32) -> f64 {
    1.0 / (values.iter().map(|v| v * v).sum::<f64>() / values.len() as f64 + f64::from(eps)).sqrt()
}

/// `mamba3_preprocess_fwd`.
pub struct PreprocessFwd;

impl OpDef for PreprocessFwd {
    const NAME: &'static str = "mamba3_preprocess_fwd";
    type Problem = PreprocessProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<PreprocessProblem> {
        check_common(shapes, scalars)
    }

    fn reference(p: &PreprocessProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        let projected = inputs["projected"].data();
        let dt_bias = inputs["dt_bias"].data();
        let weights = [inputs.get("b_norm_weight").map(|t| t.data()), inputs.get("c_norm_weight").map(|t| t.data())];
        let width = p.width();
        let bc = p.bc_rows * p.state;
        let mut normed = [vec![0.0; p.rows * bc], vec![0.0; p.rows * bc]];
        let mut dt = vec![0.0; p.rows * p.heads];
        let mut adt = vec![0.0; p.rows * p.heads];
        for row in 0..p.rows {
            let line = &projected[row * width..(row + 1) * width];
            for (which, offset) in [p.b_offset(), p.c_offset()].into_iter().enumerate() {
                for group in 0..p.bc_rows {
                    let values = &line[offset + group * p.state..offset + (group + 1) * p.state];
                    let r = inverse_rms(values, p.eps);
                    for (i, v) in values.iter().enumerate() {
                        normed[which][row * bc + group * p.state + i] = v * r * weights[which].map_or(1.0, |w| w[i]);
                    }
                }
            }
            for h in 0..p.heads {
                let (_, step, a) = dt_and_a(p, line[p.dd_dt_offset() + h] + dt_bias[h], line[p.dd_a_offset() + h]);
                dt[row * p.heads + h] = step;
                adt[row * p.heads + h] = a * step;
            }
        }
        let [bh, ch] = normed;
        let shape3 = vec![p.rows, p.bc_rows, p.state];
        let mut out = TensorMap::new();
        out.insert("bh".into(), Tensor::from_parts(shape3.clone(), bh));
        out.insert("ch".into(), Tensor::from_parts(shape3, ch));
        out.insert("dt".into(), Tensor::from_parts(vec![p.rows, p.heads], dt));
        out.insert("adt".into(), Tensor::from_parts(vec![p.rows, p.heads], adt));
        out
    }

    fn record(p: &PreprocessProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        let mut recorded = Recorded::default();
        let mut push = base_push(p, inputs, Self::NAME)?;
        push.bh = recorded.output(gpu, Self::NAME, "bh", vec![p.rows, p.bc_rows, p.state])?;
        push.ch = recorded.output(gpu, Self::NAME, "ch", vec![p.rows, p.bc_rows, p.state])?;
        push.dt = recorded.output(gpu, Self::NAME, "dt", vec![p.rows, p.heads])?;
        push.adt = recorded.output(gpu, Self::NAME, "adt", vec![p.rows, p.heads])?;
        let groups = p.rows.div_ceil(ROWS_PER_WORKGROUP) as u64;
        recorded.dispatches.push(Dispatch::linear(kernels::mamba3_preprocess::MAMBA3_PREPROCESS_FWD, groups, &push)?);
        Ok(recorded)
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        example_inputs(&PreprocessShape::for_size(size), false, seed)
    }

    fn traffic_bytes(p: &PreprocessProblem) -> u64 {
        let per_row = 2 * (2 * p.bc_rows * p.state + 2 * p.heads);
        4 * (p.rows * per_row + p.heads + 2 * p.state) as u64
    }
}

/// `mamba3_preprocess_bwd`.
pub struct PreprocessBwd;

impl OpDef for PreprocessBwd {
    const NAME: &'static str = "mamba3_preprocess_bwd";
    type Problem = PreprocessProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<PreprocessProblem> {
        let p = check_common(shapes, scalars)?;
        shapes.exact("dz", &[("rows", p.rows), ("inner", p.inner)])?;
        shapes.exact("dx", &[("rows", p.rows), ("inner", p.inner)])?;
        shapes.exact("dbh", &[("rows", p.rows), ("bc_rows", p.bc_rows), ("state", p.state)])?;
        shapes.exact("dch", &[("rows", p.rows), ("bc_rows", p.bc_rows), ("state", p.state)])?;
        for name in ["ddt", "dadt", "dtrap"] {
            shapes.exact(name, &[("rows", p.rows), ("heads", p.heads)])?;
        }
        shapes.exact("dangles", &[("rows", p.rows), ("rope_angles", p.rope_angles)])?;
        Ok(p)
    }

    fn reference(p: &PreprocessProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        let projected = inputs["projected"].data();
        let dt_bias = inputs["dt_bias"].data();
        let weights = [inputs.get("b_norm_weight").map(|t| t.data()), inputs.get("c_norm_weight").map(|t| t.data())];
        let upstream = [inputs["dbh"].data(), inputs["dch"].data()];
        let (dz, dx) = (inputs["dz"].data(), inputs["dx"].data());
        let (ddt, dadt, dtrap) = (inputs["ddt"].data(), inputs["dadt"].data(), inputs["dtrap"].data());
        let dangles = inputs["dangles"].data();
        let width = p.width();
        let bc = p.bc_rows * p.state;
        let n = p.state as f64;
        let mut dprojected = vec![0.0; p.rows * width];
        let mut dweights = [vec![0.0; p.state], vec![0.0; p.state]];
        let mut ddt_bias = vec![0.0; p.heads];
        for row in 0..p.rows {
            let line = &projected[row * width..(row + 1) * width];
            let out = &mut dprojected[row * width..(row + 1) * width];
            for (which, offset) in [p.b_offset(), p.c_offset()].into_iter().enumerate() {
                for group in 0..p.bc_rows {
                    let start = offset + group * p.state;
                    let values = &line[start..start + p.state];
                    let grads = &upstream[which][row * bc + group * p.state..][..p.state];
                    let r = inverse_rms(values, p.eps);
                    let u = |i: usize| grads[i] * weights[which].map_or(1.0, |w| w[i]);
                    let dot: f64 = (0..p.state).map(|i| u(i) * values[i]).sum();
                    for i in 0..p.state {
                        out[start + i] = r * u(i) - values[i] * r * r * r * dot / n;
                        dweights[which][i] += grads[i] * values[i] * r;
                    }
                }
            }
            out[..p.inner].copy_from_slice(&dz[row * p.inner..(row + 1) * p.inner]);
            out[p.inner..2 * p.inner].copy_from_slice(&dx[row * p.inner..(row + 1) * p.inner]);
            for h in 0..p.heads {
                let index = row * p.heads + h;
                let raw_dt = line[p.dd_dt_offset() + h] + dt_bias[h];
                let raw_a = line[p.dd_a_offset() + h];
                let (softplus_value, step, a) = dt_and_a(p, raw_dt, raw_a);
                let dt_total = ddt[index] + dadt[index] * a;
                let dt_mask =
                    f64::from(u8::from(f64::from(p.dt_min) <= softplus_value && softplus_value <= f64::from(p.dt_max)));
                let raw_dt_gradient = dt_total * dt_mask * softplus_derivative(raw_dt);
                out[p.dd_dt_offset() + h] = raw_dt_gradient;
                ddt_bias[h] += raw_dt_gradient;
                let a_mask = f64::from(u8::from(heavy_tail(raw_a) > f64::from(p.a_floor)));
                out[p.dd_a_offset() + h] = -dadt[index] * step * a_mask * heavy_tail_derivative(raw_a);
                out[p.trap_offset() + h] = dtrap[index];
            }
            out[p.angle_offset()..].copy_from_slice(&dangles[row * p.rope_angles..(row + 1) * p.rope_angles]);
        }
        let [db_norm_weight, dc_norm_weight] = dweights;
        let mut result = TensorMap::new();
        result.insert("dprojected".into(), Tensor::from_parts(vec![p.rows, width], dprojected));
        result.insert("ddt_bias".into(), Tensor::from_parts(vec![p.heads], ddt_bias));
        if p.has_b_weight {
            result.insert("db_norm_weight".into(), Tensor::from_parts(vec![p.state], db_norm_weight));
        }
        if p.has_c_weight {
            result.insert("dc_norm_weight".into(), Tensor::from_parts(vec![p.state], dc_norm_weight));
        }
        result
    }

    fn record(p: &PreprocessProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        let mut recorded = Recorded::default();
        let mut push = base_push(p, inputs, Self::NAME)?;
        push.dprojected = recorded.output(gpu, Self::NAME, "dprojected", vec![p.rows, p.width()])?;
        let partial_rows = p.rows * p.bc_rows;
        if p.has_b_weight {
            push.b_weight_partial =
                recorded.scratch(gpu, Self::NAME, "db_norm_weight partials", partial_rows * p.state)?;
        }
        if p.has_c_weight {
            push.c_weight_partial =
                recorded.scratch(gpu, Self::NAME, "dc_norm_weight partials", partial_rows * p.state)?;
        }
        let groups = p.rows.div_ceil(ROWS_PER_WORKGROUP) as u64;
        recorded.dispatches.push(Dispatch::linear(kernels::mamba3_preprocess::MAMBA3_PREPROCESS_BWD, groups, &push)?);

        let ddt_bias = recorded.output(gpu, Self::NAME, "ddt_bias", vec![p.heads])?;
        let dt_columns = Partials {
            slot: push.dprojected,
            rows: p.rows,
            cols: p.heads,
            offset: p.dd_dt_offset(),
            row_stride: p.width(),
        };
        column_sums(&mut recorded, gpu, Self::NAME, dt_columns, ddt_bias)?;
        for (given, name, partial) in [
            (p.has_b_weight, "db_norm_weight", push.b_weight_partial),
            (p.has_c_weight, "dc_norm_weight", push.c_weight_partial),
        ] {
            if given {
                let output = recorded.output(gpu, Self::NAME, name, vec![p.state])?;
                let partials =
                    Partials { slot: partial, rows: partial_rows, cols: p.state, offset: 0, row_stride: p.state };
                column_sums(&mut recorded, gpu, Self::NAME, partials, output)?;
            }
        }
        Ok(recorded)
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        example_inputs(&PreprocessShape::for_size(size), true, seed)
    }

    fn traffic_bytes(p: &PreprocessProblem) -> u64 {
        let bc = p.bc_rows * p.state;
        let reads = 2 * bc + 2 * p.heads + 2 * p.inner + 2 * bc + 3 * p.heads + p.rope_angles;
        4 * (p.rows * (reads + p.width()) + p.heads + 2 * p.state) as u64
    }
}

/// The sizes and options of one preprocess test or benchmark case.
#[derive(Clone, Debug)]
pub struct PreprocessShape {
    pub rows: usize,
    pub inner: usize,
    pub state: usize,
    pub heads: usize,
    pub bc_rows: usize,
    pub rope_angles: usize,
    pub norm_weights: bool,
    /// `Some((dt_min, dt_max))` to clamp dt; `None` for the default `(0, inf)`.
    pub dt_clamp: Option<(f32, f32)>,
}

impl PreprocessShape {
    /// The size `make run` uses (mamba.md §7.1 defaults for a 768-wide model).
    pub fn realistic(rows: usize) -> Self {
        PreprocessShape {
            rows,
            inner: 1536,
            state: 128,
            heads: 24,
            bc_rows: 1,
            rope_angles: 32,
            norm_weights: true,
            dt_clamp: None,
        }
    }

    /// `realistic` at B·L = 8·2048 rows on a GPU and 2·2048 on a CPU device; a tiny case for `Small`.
    pub fn for_size(size: ExampleSize) -> Self {
        match size {
            ExampleSize::Small => PreprocessShape {
                rows: 7,
                inner: 64,
                state: 16,
                heads: 4,
                bc_rows: 2,
                rope_angles: 4,
                norm_weights: true,
                dt_clamp: None,
            },
            ExampleSize::CpuDevice => Self::realistic(2 * 2048),
            ExampleSize::Gpu => Self::realistic(8 * 2048),
        }
    }

    pub fn width(&self) -> usize {
        2 * self.inner + 2 * self.bc_rows * self.state + 3 * self.heads + self.rope_angles
    }
}

/// Random inputs away from every kink: dd_a is never near 0, dt_bias is the official
/// inverse-softplus init of a log-uniform dt in [1e-3, 1e-1].
pub fn example_inputs(shape: &PreprocessShape, backward: bool, seed: u64) -> (TensorMap, Scalars) {
    let mut rng = Rng::new(seed);
    let s = shape;
    let width = s.width();
    let dd_dt_offset = 2 * s.inner + 2 * s.bc_rows * s.state;
    let dd_a_offset = dd_dt_offset + s.heads;
    let mut projected = rng.normal_tensor(vec![s.rows, width], 1.0);
    for row in 0..s.rows {
        for h in 0..s.heads {
            let magnitude = rng.uniform(0.05, 3.0);
            let sign = if rng.unit() < 0.5 { -1.0 } else { 1.0 };
            projected.data_mut()[row * width + dd_a_offset + h] = (sign * magnitude) as f32;
            projected.data_mut()[row * width + dd_dt_offset + h] = (0.5 * rng.normal()) as f32;
        }
    }
    let dt_bias = Tensor::from_fn(vec![s.heads], |_| {
        let dt = rng.log_uniform(1e-3, 1e-1);
        (dt + (-(-dt).exp_m1()).ln()) as f32
    });
    let mut inputs = TensorMap::new();
    inputs.insert("projected".into(), projected);
    inputs.insert("dt_bias".into(), dt_bias);
    if s.norm_weights {
        inputs.insert("b_norm_weight".into(), rng.uniform_tensor(vec![s.state], 0.5, 1.5));
        inputs.insert("c_norm_weight".into(), rng.uniform_tensor(vec![s.state], 0.5, 1.5));
    }
    if backward {
        inputs.insert("dz".into(), rng.normal_tensor(vec![s.rows, s.inner], 1.0));
        inputs.insert("dx".into(), rng.normal_tensor(vec![s.rows, s.inner], 1.0));
        inputs.insert("dbh".into(), rng.normal_tensor(vec![s.rows, s.bc_rows, s.state], 1.0));
        inputs.insert("dch".into(), rng.normal_tensor(vec![s.rows, s.bc_rows, s.state], 1.0));
        inputs.insert("ddt".into(), rng.normal_tensor(vec![s.rows, s.heads], 1.0));
        inputs.insert("dadt".into(), rng.normal_tensor(vec![s.rows, s.heads], 1.0));
        inputs.insert("dtrap".into(), rng.normal_tensor(vec![s.rows, s.heads], 1.0));
        inputs.insert("dangles".into(), rng.normal_tensor(vec![s.rows, s.rope_angles], 1.0));
    }
    let mut scalars = Scalars::new()
        .with("inner", s.inner)
        .with("state", s.state)
        .with("heads", s.heads)
        .with("bc_rows", s.bc_rows)
        .with("rope_angles", s.rope_angles);
    if let Some((dt_min, dt_max)) = s.dt_clamp {
        scalars.set("dt_min", dt_min);
        scalars.set("dt_max", dt_max);
    }
    (inputs, scalars)
}

/// Overwrites the first rows so that they hit every branch: heavy_tail's two sides and its floor,
/// softplus far below, near and above its threshold of 20.
pub fn force_branches(shape: &PreprocessShape, inputs: &mut TensorMap) {
    const DD_A: [f32; 5] = [-1e4, -3.0, -1e-7, 1e-7, 5.0];
    const RAW_DT: [f32; 6] = [-30.0, -7.0, 0.0, 19.9, 20.1, 40.0];
    let width = shape.width();
    let dd_dt_offset = 2 * shape.inner + 2 * shape.bc_rows * shape.state;
    let dd_a_offset = dd_dt_offset + shape.heads;
    let dt_bias: Vec<f32> = inputs["dt_bias"].data().to_vec();
    let Some(projected) = inputs.get_mut("projected").map(Tensor::data_mut) else { return };
    for row in 0..shape.rows.min(DD_A.len().max(RAW_DT.len())) {
        for h in 0..shape.heads {
            let k = row + h;
            projected[row * width + dd_a_offset + h] = DD_A[k % DD_A.len()];
            projected[row * width + dd_dt_offset + h] = RAW_DT[k % RAW_DT.len()] - dt_bias[h];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{finite_difference_error, weighted_sum};

    #[test]
    fn push_layout_matches_reflection() {
        crate::gpu::check_push_layout::<PreprocessPush>(kernels::mamba3_preprocess::FILE).unwrap();
    }

    fn problem_of(shape: &PreprocessShape) -> PreprocessProblem {
        let (dt_min, dt_max) = shape.dt_clamp.unwrap_or((0.0, f32::INFINITY));
        PreprocessProblem {
            rows: shape.rows,
            inner: shape.inner,
            state: shape.state,
            heads: shape.heads,
            bc_rows: shape.bc_rows,
            rope_angles: shape.rope_angles,
            has_b_weight: shape.norm_weights,
            has_c_weight: shape.norm_weights,
            eps: 1e-5,
            dt_min,
            dt_max,
            a_floor: 1e-4,
        }
    }

    /// The loss covers every output, plus the z, x, trap and angle slices that pass straight
    /// through `projected` to the scan (their gradients arrive as dz, dx, dtrap, dangles).
    #[test]
    fn reference_backward_matches_finite_differences() {
        for (weights, clamp, bc_rows) in [(true, None, 2), (false, Some((1e-3f32, 1e-1f32)), 1)] {
            let shape = PreprocessShape {
                rows: 3,
                inner: 2,
                state: 5,
                heads: 3,
                bc_rows,
                rope_angles: 2,
                norm_weights: weights,
                dt_clamp: clamp,
            };
            let p = problem_of(&shape);
            let (inputs, _) = example_inputs(&shape, true, 11);
            let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
            let mut output_weights = TensorMap::new();
            for (out, grad) in [("bh", "dbh"), ("ch", "dch"), ("dt", "ddt"), ("adt", "dadt")] {
                output_weights.insert(out.to_string(), wide[grad].clone());
            }
            let width = p.width();
            let pass_through = |i: &TensorMap<f64>| -> f64 {
                let x = i["projected"].data();
                let mut sum = 0.0;
                for row in 0..p.rows {
                    for c in 0..p.inner {
                        sum += x[row * width + c] * wide["dz"].data()[row * p.inner + c];
                        sum += x[row * width + p.inner + c] * wide["dx"].data()[row * p.inner + c];
                    }
                    for h in 0..p.heads {
                        sum += x[row * width + p.trap_offset() + h] * wide["dtrap"].data()[row * p.heads + h];
                    }
                    for a in 0..p.rope_angles {
                        sum += x[row * width + p.angle_offset() + a] * wide["dangles"].data()[row * p.rope_angles + a];
                    }
                }
                sum
            };
            let loss =
                |i: &TensorMap<f64>| weighted_sum(&PreprocessFwd::reference(&p, i), &output_weights) + pass_through(i);
            let grads = PreprocessBwd::reference(&p, &wide);
            let names: Vec<&str> = if weights {
                vec!["projected", "dt_bias", "b_norm_weight", "c_norm_weight"]
            } else {
                vec!["projected", "dt_bias"]
            };
            let (error, at) = finite_difference_error(&loss, &wide, &grads, &names, 400, 1e-6);
            assert!(error < 1e-6, "weights {weights} clamp {clamp:?}: {error:e} at {at}");
        }
    }
}
