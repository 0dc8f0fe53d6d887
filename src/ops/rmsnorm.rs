//! `rmsnorm_fwd` / `rmsnorm_bwd`: row-wise RMSNorm with an optional learned scale.
//! y = x · r · weight, r = 1 / sqrt(mean(x²) + eps). The weight gradient is summed over rows in
//! a fixed order: per-block partials in the kernel, then `column_sum`.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, NO_BUFFER};
use crate::kernels;
use crate::ops::reduce::{column_sums, Partials};
use crate::ops::{optional_slot, slot, ExampleSize, GpuTensors, OpDef, Recorded, ScalarCheck, ShapeCheck};
use crate::push_constants;
use crate::random::Rng;
use crate::tensor::{Scalars, Tensor, TensorMap};

push_constants! {
    /// Push constants of `rmsnorm.slang` (both entry points).
    pub struct RmsNormPush {
        x: u32,
        weight: u32,
        y: u32,
        rstd: u32,
        dy: u32,
        dx: u32,
        dweight_partial: u32,
        rows: u32,
        n: u32,
        rows_per_block: u32,
        eps: f32,
    }
}
const _: () = assert!(std::mem::size_of::<RmsNormPush>() == kernels::rmsnorm::PUSH_CONSTANT_BYTES);

/// Validated sizes and scalars of one call.
#[derive(Clone, Debug)]
pub struct RmsNormProblem {
    pub rows: usize,
    pub n: usize,
    pub has_weight: bool,
    pub eps: f32,
}

/// Longest row (a multiple of 4) that `rmsnorm_bwd_resident` keeps in registers
/// (4 * TEAM_LANES * RESIDENT_FLOAT4 in the shader); longer rows take `rmsnorm_bwd`, which reads
/// each block twice. Both sum in the same order.
const RESIDENT_ROW_FLOATS: usize = 1536;

impl RmsNormProblem {
    /// Rows one backward workgroup handles (ROWS_PER_BLOCK in the shader): a constant, so the
    /// order in which the weight gradient is summed depends on the shape alone.
    pub fn rows_per_block(&self) -> usize {
        8
    }
}

fn check_common(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<RmsNormProblem> {
    let x = shapes.required("x", &["rows", "n"])?;
    let (rows, n) = (x[0], x[1]);
    let has_weight = shapes.exact_optional("weight", &[("n", n)])?;
    let eps = scalars.finite_f32_or("eps", 1e-5)?;
    if eps < 0.0 {
        return Err(scalars.error("eps", format!("must be >= 0, got {eps}")));
    }
    Ok(RmsNormProblem { rows, n, has_weight, eps })
}

fn push(problem: &RmsNormProblem, inputs: &GpuTensors) -> Result<RmsNormPush> {
    Ok(RmsNormPush {
        x: slot(inputs, "rmsnorm", "x")?,
        weight: optional_slot(inputs, "weight"),
        dy: optional_slot(inputs, "dy"),
        y: NO_BUFFER,
        rstd: NO_BUFFER,
        dx: NO_BUFFER,
        dweight_partial: NO_BUFFER,
        rows: problem.rows as u32,
        n: problem.n as u32,
        rows_per_block: problem.rows_per_block() as u32,
        eps: problem.eps,
    })
}

/// Per-row inverse rms in f64.
fn inverse_rms(x: &[f64], n: usize, eps: f32) -> Vec<f64> {
    x.chunks(n).map(|row| 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / n as f64 + f64::from(eps)).sqrt()).collect()
}

/// `rmsnorm_fwd`.
pub struct RmsNormFwd;

impl OpDef for RmsNormFwd {
    const NAME: &'static str = "rmsnorm_fwd";
    type Problem = RmsNormProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<RmsNormProblem> {
        check_common(shapes, scalars)
    }

    fn reference(p: &RmsNormProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        let x = inputs["x"].data();
        let weight = inputs.get("weight").map(|w| w.data());
        let rstd = inverse_rms(x, p.n, p.eps);
        let y = Tensor::from_fn(vec![p.rows, p.n], |i| {
            let (row, column) = (i / p.n, i % p.n);
            x[i] * rstd[row] * weight.map_or(1.0, |w| w[column])
        });
        let mut out = TensorMap::new();
        out.insert("y".into(), y);
        out.insert("rstd".into(), Tensor::from_parts(vec![p.rows], rstd));
        out
    }

    fn record(p: &RmsNormProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        let mut recorded = Recorded::default();
        let mut push = push(p, inputs)?;
        push.y = recorded.output(gpu, Self::NAME, "y", vec![p.rows, p.n])?;
        push.rstd = recorded.output(gpu, Self::NAME, "rstd", vec![p.rows])?;
        let groups = p.rows.div_ceil(8) as u64; // 8 teams of 32 lanes, one row each
        recorded.dispatches.push(Dispatch::linear(kernels::rmsnorm::RMSNORM_FWD, groups, &push)?);
        Ok(recorded)
    }

    fn traffic_bytes(p: &RmsNormProblem) -> u64 {
        4 * (2 * p.rows * p.n + p.rows + if p.has_weight { p.n } else { 0 }) as u64
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        let (rows, n) = example_size(size);
        example_inputs(rows, n, true, false, seed)
    }
}

/// `rmsnorm_bwd`.
pub struct RmsNormBwd;

impl OpDef for RmsNormBwd {
    const NAME: &'static str = "rmsnorm_bwd";
    type Problem = RmsNormProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<RmsNormProblem> {
        let problem = check_common(shapes, scalars)?;
        shapes.exact("dy", &[("rows", problem.rows), ("n", problem.n)])?;
        Ok(problem)
    }

    fn reference(p: &RmsNormProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        let x = inputs["x"].data();
        let dy = inputs["dy"].data();
        let weight = inputs.get("weight").map(|w| w.data());
        let rstd = inverse_rms(x, p.n, p.eps);
        let mut dx = vec![0.0; p.rows * p.n];
        let mut dweight = vec![0.0; p.n];
        for (row, &r) in rstd.iter().enumerate().take(p.rows) {
            let base = row * p.n;
            let u = |j: usize| dy[base + j] * weight.map_or(1.0, |w| w[j]);
            let dot: f64 = (0..p.n).map(|j| u(j) * x[base + j]).sum();
            for j in 0..p.n {
                dx[base + j] = r * u(j) - x[base + j] * r * r * r * dot / p.n as f64;
                dweight[j] += dy[base + j] * x[base + j] * r;
            }
        }
        let mut out = TensorMap::new();
        out.insert("dx".into(), Tensor::from_parts(vec![p.rows, p.n], dx));
        if p.has_weight {
            out.insert("dweight".into(), Tensor::from_parts(vec![p.n], dweight));
        }
        out
    }

    fn record(p: &RmsNormProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        let mut recorded = Recorded::default();
        let mut push = push(p, inputs)?;
        push.dx = recorded.output(gpu, Self::NAME, "dx", vec![p.rows, p.n])?;
        let blocks = p.rows.div_ceil(p.rows_per_block());
        if p.has_weight {
            push.dweight_partial = recorded.scratch(gpu, Self::NAME, "dweight partials", blocks * p.n)?;
        }
        let kernel = if p.n % 4 == 0 && p.n <= RESIDENT_ROW_FLOATS {
            kernels::rmsnorm::RMSNORM_BWD_RESIDENT
        } else {
            kernels::rmsnorm::RMSNORM_BWD
        };
        recorded.dispatches.push(Dispatch::linear(kernel, blocks as u64, &push)?);
        if p.has_weight {
            let dweight = recorded.output(gpu, Self::NAME, "dweight", vec![p.n])?;
            let partials = Partials { slot: push.dweight_partial, rows: blocks, cols: p.n, offset: 0, row_stride: p.n };
            column_sums(&mut recorded, gpu, Self::NAME, partials, dweight)?;
        }
        Ok(recorded)
    }

    fn traffic_bytes(p: &RmsNormProblem) -> u64 {
        4 * (3 * p.rows * p.n + if p.has_weight { 2 * p.n } else { 0 }) as u64
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        let (rows, n) = example_size(size);
        example_inputs(rows, n, true, true, seed)
    }

    /// The small example (rows kept in registers) and one row too long for that (read twice).
    fn coverage_examples(seed: u64) -> Vec<(TensorMap, Scalars)> {
        vec![Self::example(ExampleSize::Small, seed), example_inputs(3, RESIDENT_ROW_FLOATS + 4, true, true, seed)]
    }
}

/// (rows, n) of each example size: the benchmark normalises B·L = 8·2048 rows of width 1536.
fn example_size(size: ExampleSize) -> (usize, usize) {
    match size {
        ExampleSize::Small => (7, 64),
        ExampleSize::CpuDevice => (2 * 2048, 1536),
        ExampleSize::Gpu => (8 * 2048, 1536),
    }
}

/// Random inputs for `rmsnorm_fwd` (and, with `backward`, `rmsnorm_bwd`).
pub fn example_inputs(rows: usize, n: usize, weight: bool, backward: bool, seed: u64) -> (TensorMap, Scalars) {
    let mut rng = Rng::new(seed);
    let mut inputs = TensorMap::new();
    inputs.insert("x".into(), rng.normal_tensor(vec![rows, n], 1.0));
    if weight {
        inputs.insert("weight".into(), rng.uniform_tensor(vec![n], 0.5, 1.5));
    }
    if backward {
        inputs.insert("dy".into(), rng.normal_tensor(vec![rows, n], 1.0));
    }
    (inputs, Scalars::new().with("eps", 1e-5))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{finite_difference_error, weighted_sum};

    #[test]
    fn push_layout_matches_reflection() {
        crate::gpu::check_push_layout::<RmsNormPush>(kernels::rmsnorm::FILE).unwrap();
    }

    #[test]
    fn reference_backward_matches_finite_differences() {
        for &(rows, n, weight) in &[(3, 5, true), (2, 7, false), (1, 1, true)] {
            let (inputs, _) = example_inputs(rows, n, weight, true, 7);
            let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
            let p = RmsNormProblem { rows, n, has_weight: weight, eps: 1e-5 };
            let mut weights = TensorMap::new();
            weights.insert("y".to_string(), wide["dy"].clone());
            let loss = |i: &TensorMap<f64>| weighted_sum(&RmsNormFwd::reference(&p, i), &weights);
            let grads = RmsNormBwd::reference(&p, &wide);
            let names: &[&str] = if weight { &["x", "weight"] } else { &["x"] };
            let (error, at) = finite_difference_error(&loss, &wide, &grads, names, 64, 1e-6);
            assert!(error < 1e-6, "rows {rows} n {n} weight {weight}: {error:e} at {at}");
        }
    }
}
