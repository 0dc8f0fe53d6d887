//! `causal_conv1d_fwd` / `causal_conv1d_bwd` (spec/mamba.md §2): depthwise causal convolution over
//! time of a channel-first `x` [B, D, L] with `weight` [D, W] (2 ≤ W ≤ 8), optional `bias` [D],
//! optional `initial_states` [B, D, W−1] (the W−1 samples before t = 0) and optional SiLU:
//!
//! pre_t = bias + Σ_{w<W} weight[:, w]·x_{t−(W−1)+w},  out_t = silu(pre_t) when `silu` is 1,
//!
//! `final_states` = the last W−1 samples of the input (initial states in front when L < W−1).
//! The backward recomputes pre, so it reads x and dout once each; the weight and bias gradients sum
//! over batch and time through per-(b, d, segment) partials and `column_sum`, in a fixed order.
//!
//! Work split (the same for both directions, a function of the shape alone): a row (b, d) is cut
//! into quads of 4 consecutive time steps; a team of `team` lanes (a power of two ≤ 256, inside one
//! workgroup of 256) covers one segment of `team · iters` quads of one row, lane l taking quads
//! l, l + team, … of the segment.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, NO_BUFFER};
use crate::kernels::{self, KernelRef};
use crate::ops::math::{silu, silu_derivative};
use crate::ops::reduce::{column_sums, Partials};
use crate::ops::{optional_slot, slot, ExampleSize, GpuTensors, OpDef, Recorded, ScalarCheck, ShapeCheck};
use crate::push_constants;
use crate::random::Rng;
use crate::tensor::{Scalars, Tensor, TensorMap};

push_constants! {
    /// Push constants of `causal_conv1d.slang` (every entry point).
    pub struct CausalConv1dPush {
        x: u32,
        weight: u32,
        bias: u32,
        initial_states: u32,
        out: u32,
        final_states: u32,
        dout: u32,
        dfinal_states: u32,
        dx: u32,
        dinitial_states: u32,
        partials: u32,
        batch: u32,
        dim: u32,
        length: u32,
        width: u32,
        silu: u32,
        team: u32,
        iters: u32,
        segments: u32,
    }
}
const _: () = assert!(std::mem::size_of::<CausalConv1dPush>() == kernels::causal_conv1d::PUSH_CONSTANT_BYTES);

/// Lanes per workgroup (`WORKGROUP` in the shader).
const WORKGROUP: usize = 256;
/// Time steps per quad: one float4 per lane and step.
const QUAD: usize = 4;
/// Quads one lane covers per segment at most: a segment of a long row is 256 · 4 · 4 = 4096 steps.
const MAX_ITERS: usize = 4;
/// Supported kernel widths.
const MIN_WIDTH: usize = 2;
const MAX_WIDTH: usize = 8;

/// The widest kernel the narrow entry points serve; wider ones (up to 8) use the wide ones. Each
/// entry point has a window of fixed size in registers; a narrower kernel runs with zero taps in
/// front, which leaves every bit of the result unchanged for finite inputs.
const NARROW_WIDTH: usize = 4;

fn forward_kernel(width: usize) -> KernelRef {
    if width <= NARROW_WIDTH {
        kernels::causal_conv1d::CAUSAL_CONV1D_FWD_UPTO4
    } else {
        kernels::causal_conv1d::CAUSAL_CONV1D_FWD_UPTO8
    }
}

fn backward_kernel(width: usize) -> KernelRef {
    if width <= NARROW_WIDTH {
        kernels::causal_conv1d::CAUSAL_CONV1D_BWD_UPTO4
    } else {
        kernels::causal_conv1d::CAUSAL_CONV1D_BWD_UPTO8
    }
}

/// Validated sizes and flags of one call.
#[derive(Clone, Debug)]
pub struct ConvProblem {
    pub batch: usize,
    pub dim: usize,
    pub length: usize,
    pub width: usize,
    pub has_bias: bool,
    pub has_initial_states: bool,
    /// Backward only: whether `dfinal_states` was given.
    pub has_dfinal_states: bool,
    pub silu: bool,
}

impl ConvProblem {
    /// W − 1: the samples before t that output t reads.
    pub fn halo(&self) -> usize {
        self.width - 1
    }
    fn quads(&self) -> usize {
        self.length.div_ceil(QUAD)
    }
    /// Lanes per segment: a power of two, at most a workgroup.
    pub fn team(&self) -> usize {
        self.quads().next_power_of_two().min(WORKGROUP)
    }
    /// Quads each lane covers in a segment.
    pub fn iters(&self) -> usize {
        self.quads().div_ceil(self.team()).min(MAX_ITERS)
    }
    /// Segments per row; the gradient partials have one row per (b, segment).
    pub fn segments(&self) -> usize {
        self.quads().div_ceil(self.team() * self.iters())
    }
    fn workgroups(&self) -> usize {
        let teams_per_group = WORKGROUP / self.team();
        (self.batch * self.dim * self.segments()).div_ceil(teams_per_group)
    }
    fn elements(&self) -> usize {
        self.batch * self.dim * self.length
    }
    fn state_elements(&self) -> usize {
        self.batch * self.dim * self.halo()
    }
}

fn check_common(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<ConvProblem> {
    let x = shapes.required("x", &["B", "D", "L"])?;
    let (batch, dim, length) = (x[0], x[1], x[2]);
    let weight = shapes.required("weight", &["D", "W"])?;
    if weight[0] != dim {
        return Err(shapes.error("weight", format!("expected [D={dim}, W] (D from `x` {x:?}), got {weight:?}")));
    }
    let width = weight[1];
    if !(MIN_WIDTH..=MAX_WIDTH).contains(&width) {
        return Err(shapes.error(
            "weight",
            format!(
                "kernel width W = {width} (shape {weight:?}) is out of range: expected {MIN_WIDTH} ≤ W ≤ {MAX_WIDTH}"
            ),
        ));
    }
    let has_bias = shapes.exact_optional("bias", &[("D", dim)])?;
    let has_initial_states =
        shapes.exact_optional("initial_states", &[("B", batch), ("D", dim), ("W-1", width - 1)])?;
    let silu = scalars.flag_or("silu", false)?;
    Ok(ConvProblem { batch, dim, length, width, has_bias, has_initial_states, has_dfinal_states: false, silu })
}

fn base_push(p: &ConvProblem, inputs: &GpuTensors, op: &str) -> Result<CausalConv1dPush> {
    Ok(CausalConv1dPush {
        x: slot(inputs, op, "x")?,
        weight: slot(inputs, op, "weight")?,
        bias: optional_slot(inputs, "bias"),
        initial_states: optional_slot(inputs, "initial_states"),
        out: NO_BUFFER,
        final_states: NO_BUFFER,
        dout: optional_slot(inputs, "dout"),
        dfinal_states: optional_slot(inputs, "dfinal_states"),
        dx: NO_BUFFER,
        dinitial_states: NO_BUFFER,
        partials: NO_BUFFER,
        batch: p.batch as u32,
        dim: p.dim as u32,
        length: p.length as u32,
        width: p.width as u32,
        silu: u32::from(p.silu),
        team: p.team() as u32,
        iters: p.iters() as u32,
        segments: p.segments() as u32,
    })
}

/// The input of row `row` at time `t` (negative: the initial states, or zero without them).
fn sample(p: &ConvProblem, x: &[f64], initial: Option<&[f64]>, row: usize, t: isize) -> f64 {
    let halo = p.halo() as isize;
    if t >= 0 {
        x[row * p.length + t as usize]
    } else {
        debug_assert!(t >= -halo);
        initial.map_or(0.0, |s| s[row * p.halo() + (halo + t) as usize])
    }
}

/// Pre-activations of every (row, t), in f64.
fn pre_activations(p: &ConvProblem, inputs: &TensorMap<f64>) -> Vec<f64> {
    let x = inputs["x"].data();
    let weight = inputs["weight"].data();
    let bias = inputs.get("bias").map(|t| t.data());
    let initial = inputs.get("initial_states").map(|t| t.data());
    let halo = p.halo() as isize;
    let mut pre = vec![0.0; p.elements()];
    for row in 0..p.batch * p.dim {
        let d = row % p.dim;
        for t in 0..p.length {
            let mut sum = bias.map_or(0.0, |b| b[d]);
            for w in 0..p.width {
                sum += weight[d * p.width + w] * sample(p, x, initial, row, t as isize - halo + w as isize);
            }
            pre[row * p.length + t] = sum;
        }
    }
    pre
}

/// `causal_conv1d_fwd`.
pub struct CausalConv1dFwd;

impl OpDef for CausalConv1dFwd {
    const NAME: &'static str = "causal_conv1d_fwd";
    type Problem = ConvProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<ConvProblem> {
        check_common(shapes, scalars)
    }

    fn reference(p: &ConvProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        let x = inputs["x"].data();
        let initial = inputs.get("initial_states").map(|t| t.data());
        let pre = pre_activations(p, inputs);
        let out: Vec<f64> = if p.silu { pre.iter().map(|&v| silu(v)).collect() } else { pre };
        let halo = p.halo();
        let mut final_states = vec![0.0; p.state_elements()];
        for row in 0..p.batch * p.dim {
            for k in 0..halo {
                let t = p.length as isize - halo as isize + k as isize;
                final_states[row * halo + k] = sample(p, x, initial, row, t);
            }
        }
        let mut result = TensorMap::new();
        result.insert("out".into(), Tensor::from_parts(vec![p.batch, p.dim, p.length], out));
        result.insert("final_states".into(), Tensor::from_parts(vec![p.batch, p.dim, halo], final_states));
        result
    }

    fn record(p: &ConvProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        let mut recorded = Recorded::default();
        let mut push = base_push(p, inputs, Self::NAME)?;
        push.out = recorded.output(gpu, Self::NAME, "out", vec![p.batch, p.dim, p.length])?;
        push.final_states = recorded.output(gpu, Self::NAME, "final_states", vec![p.batch, p.dim, p.halo()])?;
        let kernel = forward_kernel(p.width);
        recorded.dispatches.push(Dispatch::linear(kernel, p.workgroups() as u64, &push)?);
        Ok(recorded)
    }

    /// Read x, write out; plus the small tensors (weight, bias, states).
    fn traffic_bytes(p: &ConvProblem) -> u64 {
        let states = p.state_elements() * (1 + usize::from(p.has_initial_states));
        let params = p.dim * p.width + if p.has_bias { p.dim } else { 0 };
        4 * (2 * p.elements() + states + params) as u64
    }

    /// 2·W per output for the taps, 1 for the bias, about 5 for SiLU (exp, add, divide, multiply).
    fn flops(p: &ConvProblem) -> u64 {
        (p.elements() * (2 * p.width + usize::from(p.has_bias) + if p.silu { 5 } else { 0 })) as u64
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        example_inputs(&ConvShape::for_size(size), false, seed)
    }

    /// Both kernel windows: W <= 4 and W <= 8.
    fn coverage_examples(seed: u64) -> Vec<(TensorMap, Scalars)> {
        let narrow = ConvShape::for_size(ExampleSize::Small);
        let wide = ConvShape { width: 7, ..narrow.clone() };
        vec![example_inputs(&narrow, false, seed), example_inputs(&wide, false, seed)]
    }
}

/// `causal_conv1d_bwd`.
pub struct CausalConv1dBwd;

impl OpDef for CausalConv1dBwd {
    const NAME: &'static str = "causal_conv1d_bwd";
    type Problem = ConvProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<ConvProblem> {
        let mut p = check_common(shapes, scalars)?;
        shapes.exact("dout", &[("B", p.batch), ("D", p.dim), ("L", p.length)])?;
        p.has_dfinal_states =
            shapes.exact_optional("dfinal_states", &[("B", p.batch), ("D", p.dim), ("W-1", p.halo())])?;
        Ok(p)
    }

    fn reference(p: &ConvProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        let x = inputs["x"].data();
        let weight = inputs["weight"].data();
        let initial = inputs.get("initial_states").map(|t| t.data());
        let dout = inputs["dout"].data();
        let dfinal = inputs.get("dfinal_states").map(|t| t.data());
        let pre = pre_activations(p, inputs);
        let (length, halo, width) = (p.length, p.halo(), p.width);
        let mut dx = vec![0.0; p.elements()];
        let mut dinitial = vec![0.0; p.state_elements()];
        let mut dweight = vec![0.0; p.dim * width];
        let mut dbias = vec![0.0; p.dim];
        for row in 0..p.batch * p.dim {
            let d = row % p.dim;
            // Gradient of the extended input: index τ + halo for τ in [−halo, L).
            let mut dext = vec![0.0; length + halo];
            for t in 0..length {
                let i = row * length + t;
                let dpre = if p.silu { dout[i] * silu_derivative(pre[i]) } else { dout[i] };
                dbias[d] += dpre;
                for w in 0..width {
                    // x_{t−halo+w} sits at extended index t + w.
                    dext[t + w] += weight[d * width + w] * dpre;
                    dweight[d * width + w] +=
                        dpre * sample(p, x, initial, row, t as isize - halo as isize + w as isize);
                }
            }
            if let Some(g) = dfinal {
                // final_states[k] is the sample at τ = L − halo + k, extended index L + k.
                for k in 0..halo {
                    dext[length + k] += g[row * halo + k];
                }
            }
            dx[row * length..(row + 1) * length].copy_from_slice(&dext[halo..]);
            dinitial[row * halo..(row + 1) * halo].copy_from_slice(&dext[..halo]);
        }
        let mut result = TensorMap::new();
        result.insert("dx".into(), Tensor::from_parts(vec![p.batch, p.dim, length], dx));
        result.insert("dweight".into(), Tensor::from_parts(vec![p.dim, width], dweight));
        if p.has_bias {
            result.insert("dbias".into(), Tensor::from_parts(vec![p.dim], dbias));
        }
        if p.has_initial_states {
            result.insert("dinitial_states".into(), Tensor::from_parts(vec![p.batch, p.dim, halo], dinitial));
        }
        result
    }

    fn record(p: &ConvProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        let mut recorded = Recorded::default();
        let mut push = base_push(p, inputs, Self::NAME)?;
        push.dx = recorded.output(gpu, Self::NAME, "dx", vec![p.batch, p.dim, p.length])?;
        if p.has_initial_states {
            push.dinitial_states =
                recorded.output(gpu, Self::NAME, "dinitial_states", vec![p.batch, p.dim, p.halo()])?;
        }
        // Partials: one row per (b, segment) holding [dweight (D·W) | dbias (D)].
        let partial_rows = p.batch * p.segments();
        let row_stride = p.dim * (p.width + 1);
        push.partials = recorded.scratch(gpu, Self::NAME, "dweight/dbias partials", partial_rows * row_stride)?;
        let kernel = backward_kernel(p.width);
        recorded.dispatches.push(Dispatch::linear(kernel, p.workgroups() as u64, &push)?);

        let dweight = recorded.output(gpu, Self::NAME, "dweight", vec![p.dim, p.width])?;
        let weight_columns =
            Partials { slot: push.partials, rows: partial_rows, cols: p.dim * p.width, offset: 0, row_stride };
        column_sums(&mut recorded, gpu, Self::NAME, weight_columns, dweight)?;
        if p.has_bias {
            let dbias = recorded.output(gpu, Self::NAME, "dbias", vec![p.dim])?;
            let bias_columns =
                Partials { slot: push.partials, rows: partial_rows, cols: p.dim, offset: p.dim * p.width, row_stride };
            column_sums(&mut recorded, gpu, Self::NAME, bias_columns, dbias)?;
        }
        Ok(recorded)
    }

    /// Read x and dout, write dx; plus the small tensors (weight, bias, states and their gradients).
    fn traffic_bytes(p: &ConvProblem) -> u64 {
        let states = p.state_elements() * (2 * usize::from(p.has_initial_states) + usize::from(p.has_dfinal_states));
        let params = 2 * (p.dim * p.width + if p.has_bias { p.dim } else { 0 });
        4 * (3 * p.elements() + states + params) as u64
    }

    /// Per output: the recomputed pre (2·W + 1), SiLU' (about 8), dx and dweight (2·W each), dbias (1).
    fn flops(p: &ConvProblem) -> u64 {
        (p.elements() * (6 * p.width + 2 + if p.silu { 8 } else { 0 })) as u64
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        example_inputs(&ConvShape::for_size(size), true, seed)
    }

    /// Both kernel windows: W <= 4 and W <= 8.
    fn coverage_examples(seed: u64) -> Vec<(TensorMap, Scalars)> {
        let narrow = ConvShape::for_size(ExampleSize::Small);
        let wide = ConvShape { width: 7, ..narrow.clone() };
        vec![example_inputs(&narrow, true, seed), example_inputs(&wide, true, seed)]
    }
}

/// The sizes and options of one test or benchmark case.
#[derive(Clone, Debug)]
pub struct ConvShape {
    pub batch: usize,
    pub dim: usize,
    pub length: usize,
    pub width: usize,
    pub bias: bool,
    pub silu: bool,
    pub initial_states: bool,
    /// Backward only: give `dfinal_states`.
    pub dfinal_states: bool,
}

impl ConvShape {
    /// The benchmark of the issue: B=4, D=4096, L=4096, W=4, bias and SiLU, no states; a quarter of
    /// the channels and half the length on a CPU device; a tiny case with every option for `Small`.
    pub fn for_size(size: ExampleSize) -> Self {
        let shape = |batch, dim, length, width, states| ConvShape {
            batch,
            dim,
            length,
            width,
            bias: true,
            silu: true,
            initial_states: states,
            dfinal_states: states,
        };
        match size {
            ExampleSize::Small => shape(2, 8, 37, 4, true),
            ExampleSize::CpuDevice => shape(2, 256, 2048, 4, false),
            ExampleSize::Gpu => shape(4, 4096, 4096, 4, false),
        }
    }
}

/// Random inputs: x, dout and the states standard normal, weight uniform in ±1/√W (torch's Conv1d
/// init range), bias uniform in ±0.5.
pub fn example_inputs(shape: &ConvShape, backward: bool, seed: u64) -> (TensorMap, Scalars) {
    let s = shape;
    let mut rng = Rng::new(seed);
    let bound = 1.0 / (s.width as f64).sqrt();
    let mut inputs = TensorMap::new();
    inputs.insert("x".into(), rng.normal_tensor(vec![s.batch, s.dim, s.length], 1.0));
    inputs.insert("weight".into(), rng.uniform_tensor(vec![s.dim, s.width], -bound, bound));
    if s.bias {
        inputs.insert("bias".into(), rng.uniform_tensor(vec![s.dim], -0.5, 0.5));
    }
    if s.initial_states {
        inputs.insert("initial_states".into(), rng.normal_tensor(vec![s.batch, s.dim, s.width - 1], 1.0));
    }
    if backward {
        inputs.insert("dout".into(), rng.normal_tensor(vec![s.batch, s.dim, s.length], 1.0));
        if s.dfinal_states {
            inputs.insert("dfinal_states".into(), rng.normal_tensor(vec![s.batch, s.dim, s.width - 1], 1.0));
        }
    }
    (inputs, Scalars::new().with("silu", u8::from(s.silu)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{finite_difference_error, weighted_sum};

    #[test]
    fn push_layout_matches_reflection() {
        crate::gpu::check_push_layout::<CausalConv1dPush>(kernels::causal_conv1d::FILE).unwrap();
    }

    fn problem_of(s: &ConvShape) -> ConvProblem {
        ConvProblem {
            batch: s.batch,
            dim: s.dim,
            length: s.length,
            width: s.width,
            has_bias: s.bias,
            has_initial_states: s.initial_states,
            has_dfinal_states: s.dfinal_states,
            silu: s.silu,
        }
    }

    /// The loss is ⟨dout, out⟩ + ⟨dfinal_states, final_states⟩; its gradient must match the backward
    /// reference for every differentiable input. Lengths below, at and above W−1 exercise final
    /// states that reach into the initial states.
    #[test]
    fn reference_backward_matches_finite_differences() {
        let cases = [
            // (B, D, L, W, bias, silu, initial_states, dfinal_states)
            (2, 3, 7, 4, true, true, true, true),
            (1, 2, 2, 5, true, false, true, true),
            (2, 2, 1, 3, false, true, true, false),
            (1, 3, 5, 2, false, false, false, true),
            (2, 1, 3, 8, true, true, false, false),
            (1, 2, 9, 8, false, true, true, true),
        ];
        for (i, &(batch, dim, length, width, bias, silu, initial_states, dfinal_states)) in cases.iter().enumerate() {
            let shape = ConvShape { batch, dim, length, width, bias, silu, initial_states, dfinal_states };
            let p = problem_of(&shape);
            let (inputs, _) = example_inputs(&shape, true, 40 + i as u64);
            let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
            let mut weights = TensorMap::new();
            weights.insert("out".to_string(), wide["dout"].clone());
            if dfinal_states {
                weights.insert("final_states".to_string(), wide["dfinal_states"].clone());
            }
            let loss = |t: &TensorMap<f64>| weighted_sum(&CausalConv1dFwd::reference(&p, t), &weights);
            let grads = CausalConv1dBwd::reference(&p, &wide);
            let mut names = vec!["x", "weight"];
            if bias {
                names.push("bias");
            }
            if initial_states {
                names.push("initial_states");
            }
            let (error, at) = finite_difference_error(&loss, &wide, &grads, &names, 200, 1e-6);
            assert!(error < 1e-6, "{shape:?}: {error:e} at {at}");
            assert_eq!(grads.contains_key("dbias"), bias, "{shape:?}: dbias presence");
            assert_eq!(grads.contains_key("dinitial_states"), initial_states, "{shape:?}: dinitial_states presence");
        }
    }

    /// The final states are the last W−1 samples, reaching into the initial states when L < W−1.
    #[test]
    fn reference_final_states_are_the_last_samples() {
        let shape = ConvShape {
            batch: 1,
            dim: 1,
            length: 2,
            width: 5,
            bias: false,
            silu: false,
            initial_states: true,
            dfinal_states: false,
        };
        let (inputs, _) = example_inputs(&shape, false, 3);
        let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
        let out = CausalConv1dFwd::reference(&problem_of(&shape), &wide);
        let init = wide["initial_states"].data();
        let x = wide["x"].data();
        assert_eq!(out["final_states"].data(), &[init[2], init[3], x[0], x[1]]);
    }

    #[test]
    fn work_split_covers_every_quad() {
        for length in [1, 2, 7, 8, 9, 129, 1025, 4096, 5000, 100_000] {
            let p = ConvProblem {
                batch: 1,
                dim: 1,
                length,
                width: 4,
                has_bias: false,
                has_initial_states: false,
                has_dfinal_states: false,
                silu: false,
            };
            let quads = length.div_ceil(4);
            assert!(p.team().is_power_of_two() && p.team() <= WORKGROUP);
            assert!(p.segments() * p.team() * p.iters() >= quads, "L {length}");
            assert!((p.segments() - 1) * p.team() * p.iters() < quads, "L {length}: an empty segment");
        }
    }
}
