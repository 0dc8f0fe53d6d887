//! `selective_scan_fwd` / `selective_scan_bwd`: the Mamba-1 selective scan (spec/mamba.md §1.2, §1.4).
//!
//! Per (b, d, n) with g = d / (D/G): Δ_t = softplus(delta_t + delta_bias[d]) (or without softplus),
//! h_t = exp(Δ_t·a[d,n])·h_{t−1} + Δ_t·b_t[g,n]·u_t (h₋₁ = h0 or 0), y_t = Σ_n c_t[g,n]·h_t + d[d]·u_t,
//! out_t = y_t·silu(z_t).
//!
//! GPU design (kernels in `shaders/kernels/selective_scan_{fwd,bwd,reduce}.slang`). Time is cut into
//! chunks of 128 steps; one lane owns one (b, d, chunk) and walks it four steps at a time with up
//! to 16 states in registers (larger N runs in tiles of 16 states, each a walk of its own, the
//! per-step sums over n carried between tiles through the output buffers). A lane reads its own
//! rows (u, delta, z, dout) and writes its outputs with 16-byte accesses: each 32-byte sector a
//! warp fetches is used whole by two consecutive groups of steps, so rows need no shared-memory
//! staging. A workgroup is a block of channels of one group at one (b, chunk): every 16 steps it
//! stages b and c in shared memory, where its lanes read them as broadcasts. (The first design
//! staged every row through shared memory too; with that memory and 221 registers per lane the
//! H200 ran 7 warps per SM and the pair took 19 ms: docs/PERFORMANCE.md, run 9.)
//! - forward: (1) `selective_scan_chunk_state` walks every chunk but the last from a zero state: its
//!   local end state and Σ Δ; (2) `selective_scan_chunk_combine`, one lane per (b, d, n), chains the
//!   chunks in order (a chunk's decay is exp(a·ΣΔ)) into each chunk's incoming state; (3)
//!   `selective_scan_fwd_output` re-walks every chunk from its incoming state and writes `out`, the
//!   last chunk also `last_state`. Passes 1–2 are skipped when the sequence is one chunk.
//! - backward: (1) the same chunk walk over every chunk (entry point `..._chunk_state_adjoint`),
//!   adding the chunk's local adjoint μ = Σ_s (Π_{t0≤r≤s} ā_r)·g_s·c_s (the gradient its own
//!   outputs send to the state before it);
//!   (2) the same combine, adding the reverse chain of adjoints λ_{k−1} = μ_k + exp(a·ΣΔ_k)·λ_k
//!   seeded by dlast_state; pass (1) also leaves the local state (walked from zero) and Σ Δ at every
//!   16-step boundary inside each chunk, so that the state there is local + exp(a·ΣΔ)·h_in;
//!   (3) `selective_scan_bwd_chunk` (32 channels per workgroup) takes the 16-step sub-chunks last
//!   to first, recomputes the states entering their 4-step groups (each lane's own column of
//!   shared memory), and takes the
//!   groups last to first: each group's 4 states are recomputed from its entry state and walked
//!   backwards with dh, so every gradient term is the sequential definition's own product (no
//!   per-step state is stored, nothing cancels);
//!   (4) parameter gradients: per-lane partials of da, dd, ddelta_bias summed by `column_sums`; db
//!   and dc are summed over the workgroup's 32 channels in a fixed shared-memory order once per 4
//!   steps and 4 states, then over the channel blocks of a group by `selective_scan_channel_sum`.
//!   No atomics; every order depends on the shapes alone.

use crate::error::{Error, Result};
use crate::gpu::{Dispatch, Gpu, NO_BUFFER};
use crate::kernels;
use crate::ops::math::{silu, silu_derivative, softplus, softplus_derivative};
use crate::ops::reduce::{column_sums, Partials};
use crate::ops::{optional_slot, slot, ExampleSize, GpuTensors, OpDef, Recorded, ScalarCheck, ShapeCheck};
use crate::push_constants;
use crate::random::Rng;
use crate::tensor::{Scalars, Tensor, TensorMap};

push_constants! {
    /// Push constants of `selective_scan_fwd.slang` (forward output and the chunk passes both
    /// directions share).
    pub struct ScanFwdPush {
        u: u32,
        delta: u32,
        a: u32,
        b: u32,
        c: u32,
        d: u32,
        z: u32,
        delta_bias: u32,
        h0: u32,
        out: u32,
        last_state: u32,
        chunk_state: u32,
        chunk_dsum: u32,
        dout: u32,
        chunk_adjoint: u32,
        dlast_state: u32,
        snapshots: u32,
        batch: u32,
        dim: u32,
        state: u32,
        groups: u32,
        length: u32,
        chunk_len: u32,
        chunks: u32,
        grid_chunks: u32,
        delta_softplus: u32,
    }
}
const _: () = assert!(std::mem::size_of::<ScanFwdPush>() == kernels::selective_scan_fwd::PUSH_CONSTANT_BYTES);

push_constants! {
    /// Push constants of `selective_scan_bwd.slang`.
    pub struct ScanBwdPush {
        u: u32,
        delta: u32,
        a: u32,
        b: u32,
        c: u32,
        d: u32,
        z: u32,
        delta_bias: u32,
        h0: u32,
        dout: u32,
        dlast_state: u32,
        chunk_state: u32,
        chunk_adjoint: u32,
        snapshots: u32,
        du: u32,
        ddelta: u32,
        dz: u32,
        dh0: u32,
        da_partial: u32,
        dd_partial: u32,
        ddelta_bias_partial: u32,
        db: u32,
        dc: u32,
        batch: u32,
        dim: u32,
        state: u32,
        groups: u32,
        length: u32,
        chunk_len: u32,
        chunks: u32,
        delta_softplus: u32,
    }
}
const _: () = assert!(std::mem::size_of::<ScanBwdPush>() == kernels::selective_scan_bwd::PUSH_CONSTANT_BYTES);

push_constants! {
    /// Push constants of `selective_scan_reduce.slang`.
    pub struct ScanReducePush {
        db_partial: u32,
        dc_partial: u32,
        db: u32,
        dc: u32,
        rows: u32,
        cols: u32,
    }
}
const _: () = assert!(std::mem::size_of::<ScanReducePush>() == kernels::selective_scan_reduce::PUSH_CONSTANT_BYTES);

/// Time steps one lane walks in the forward (`chunk_len` is a push constant; the host's choice is a
/// constant, so that every summation order is a function of the shape alone).
pub const FWD_CHUNK_LEN: usize = 128;
/// Time steps one lane walks in the backward: at most 128 (8 sub-chunks of 16 steps whose boundary
/// states fit in shared memory; `selective_scan_bwd.slang`).
pub const BWD_CHUNK_LEN: usize = 128;
/// Steps between the state snapshots of the backward walk (SUB_STEPS in the shader).
const BWD_SUB_STEPS: usize = 16;
/// Channels per workgroup of the forward walks (SCAN_CHANNELS in the shaders).
const FWD_LANES: usize = 64;
/// Channels per workgroup of the backward walk (SCAN_BWD_CHANNELS): db and dc are summed over them
/// in shared memory, then over the channel blocks of a group.
const BWD_LANES: usize = 32;
/// Lanes per workgroup of the per-(b, d, n) combine and the channel-sum passes.
const LINEAR_WORKGROUP: usize = 256;

/// Validated sizes, options and scalars of one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScanProblem {
    pub batch: usize,
    pub dim: usize,
    pub state: usize,
    pub groups: usize,
    pub length: usize,
    pub has_d: bool,
    pub has_z: bool,
    pub has_delta_bias: bool,
    pub has_h0: bool,
    /// Backward only: whether `dlast_state` was given.
    pub has_dlast_state: bool,
    pub delta_softplus: bool,
}

impl ScanProblem {
    fn channels_per_group(&self) -> usize {
        self.dim / self.groups
    }
    fn chunks(&self, chunk_len: usize) -> usize {
        self.length.div_ceil(chunk_len)
    }
    /// Workgroups of `lanes` channels per group (a workgroup never spans two groups).
    fn channel_blocks(&self, lanes: usize) -> usize {
        self.channels_per_group().div_ceil(lanes)
    }
    fn walk_workgroups(&self, chunks: usize, lanes: usize) -> u64 {
        (self.batch * self.groups * self.channel_blocks(lanes) * chunks) as u64
    }
    fn rows(&self) -> usize {
        self.batch * self.dim
    }
    fn bc_len(&self) -> usize {
        self.batch * self.groups * self.state * self.length
    }
    fn delta_of(&self, raw: f64, bias: f64) -> f64 {
        let x = raw + bias;
        if self.delta_softplus {
            softplus(x)
        } else {
            x
        }
    }
}

fn check_common(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<ScanProblem> {
    let delta_softplus = scalars.flag_or("delta_softplus", true)?;
    let u = shapes.required("u", &["batch", "dim", "length"])?;
    let (batch, dim, length) = (u[0], u[1], u[2]);
    shapes.exact("delta", &[("batch", batch), ("dim", dim), ("length", length)])?;
    let a = shapes.required("a", &["dim", "state"])?;
    if a[0] != dim {
        return Err(shapes.error("a", format!("expected shape [dim={dim}, state], got {a:?}")));
    }
    let state = a[1];
    let b = shapes.required("b", &["batch", "groups", "state", "length"])?;
    let groups = b[1];
    shapes.exact("b", &[("batch", batch), ("groups", groups), ("state", state), ("length", length)])?;
    if dim % groups != 0 {
        return Err(shapes.error(
            "b",
            format!("groups={groups} must divide dim={dim} (channel d reads group d / (dim/groups)), got shape {b:?}"),
        ));
    }
    shapes.exact("c", &[("batch", batch), ("groups", groups), ("state", state), ("length", length)])?;
    let has_d = shapes.exact_optional("d", &[("dim", dim)])?;
    let has_z = shapes.exact_optional("z", &[("batch", batch), ("dim", dim), ("length", length)])?;
    let has_delta_bias = shapes.exact_optional("delta_bias", &[("dim", dim)])?;
    let has_h0 = shapes.exact_optional("h0", &[("batch", batch), ("dim", dim), ("state", state)])?;
    Ok(ScanProblem {
        batch,
        dim,
        state,
        groups,
        length,
        has_d,
        has_z,
        has_delta_bias,
        has_h0,
        has_dlast_state: false,
        delta_softplus,
    })
}

/// The inputs of one call, in f64, with the optional ones defaulted.
struct Wide<'a> {
    u: &'a [f64],
    delta: &'a [f64],
    a: &'a [f64],
    b: &'a [f64],
    c: &'a [f64],
    d: Option<&'a [f64]>,
    z: Option<&'a [f64]>,
    delta_bias: Option<&'a [f64]>,
    h0: Option<&'a [f64]>,
}

impl<'a> Wide<'a> {
    fn of(inputs: &'a TensorMap<f64>) -> Self {
        let optional = |name: &str| inputs.get(name).map(|t| t.data());
        Wide {
            u: inputs["u"].data(),
            delta: inputs["delta"].data(),
            a: inputs["a"].data(),
            b: inputs["b"].data(),
            c: inputs["c"].data(),
            d: optional("d"),
            z: optional("z"),
            delta_bias: optional("delta_bias"),
            h0: optional("h0"),
        }
    }
}

/// The forward recurrence of one (b, d) row: Δ_t, every state h_{t−1} (index t) and h_t (index
/// t + 1), and the pre-gate output y_t.
struct Row {
    steps: Vec<f64>,
    states: Vec<f64>,
    y: Vec<f64>,
}

fn forward_row(p: &ScanProblem, w: &Wide, batch: usize, channel: usize) -> Row {
    let (n_state, length) = (p.state, p.length);
    let group = channel / p.channels_per_group();
    let row = batch * p.dim + channel;
    let bc_row = |n: usize| ((batch * p.groups + group) * n_state + n) * length;
    let bias = w.delta_bias.map_or(0.0, |v| v[channel]);
    let skip = w.d.map_or(0.0, |v| v[channel]);
    let mut states = vec![0.0; (length + 1) * n_state];
    if let Some(h0) = w.h0 {
        states[..n_state].copy_from_slice(&h0[row * n_state..(row + 1) * n_state]);
    }
    let mut steps = vec![0.0; length];
    let mut y = vec![0.0; length];
    for t in 0..length {
        let index = row * length + t;
        let step = p.delta_of(w.delta[index], bias);
        steps[t] = step;
        let u = w.u[index];
        let mut sum = skip * u;
        for n in 0..n_state {
            let decay = (step * w.a[channel * n_state + n]).exp();
            let h = decay * states[t * n_state + n] + step * w.b[bc_row(n) + t] * u;
            states[(t + 1) * n_state + n] = h;
            sum += w.c[bc_row(n) + t] * h;
        }
        y[t] = sum;
    }
    Row { steps, states, y }
}

/// `selective_scan_fwd`.
pub struct ScanFwd;

impl OpDef for ScanFwd {
    const NAME: &'static str = "selective_scan_fwd";
    type Problem = ScanProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<ScanProblem> {
        check_common(shapes, scalars)
    }

    fn reference(p: &ScanProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        let w = Wide::of(inputs);
        let (length, n_state) = (p.length, p.state);
        let mut out = vec![0.0; p.rows() * length];
        let mut last_state = vec![0.0; p.rows() * n_state];
        for batch in 0..p.batch {
            for channel in 0..p.dim {
                let row = batch * p.dim + channel;
                let r = forward_row(p, &w, batch, channel);
                for t in 0..length {
                    let gate = w.z.map_or(1.0, |z| silu(z[row * length + t]));
                    out[row * length + t] = r.y[t] * gate;
                }
                last_state[row * n_state..(row + 1) * n_state].copy_from_slice(&r.states[length * n_state..]);
            }
        }
        let mut result = TensorMap::new();
        result.insert("out".into(), Tensor::from_parts(vec![p.batch, p.dim, length], out));
        result.insert("last_state".into(), Tensor::from_parts(vec![p.batch, p.dim, n_state], last_state));
        result
    }

    fn record(p: &ScanProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        check_device_limits(Self::NAME, p)?;
        let mut recorded = Recorded::default();
        let mut push = fwd_push(p, inputs, Self::NAME, FWD_CHUNK_LEN)?;
        push.out = recorded.output(gpu, Self::NAME, "out", vec![p.batch, p.dim, p.length])?;
        push.last_state = recorded.output(gpu, Self::NAME, "last_state", vec![p.batch, p.dim, p.state])?;
        let chunks = p.chunks(FWD_CHUNK_LEN);
        if chunks > 1 {
            push.chunk_state = recorded.scratch(gpu, Self::NAME, "chunk states", p.rows() * chunks * p.state)?;
            push.chunk_dsum = recorded.scratch(gpu, Self::NAME, "chunk delta sums", p.rows() * chunks)?;
            record_chunk_passes(&mut recorded, p, push)?;
        }
        push.grid_chunks = chunks as u32;
        let kernel = kernels::selective_scan_fwd::SELECTIVE_SCAN_FWD_OUTPUT;
        recorded.dispatches.push(Dispatch::linear(kernel, p.walk_workgroups(chunks, FWD_LANES), &push)?);
        Ok(recorded)
    }

    fn traffic_bytes(p: &ScanProblem) -> u64 {
        let rows_l = p.rows() * p.length;
        let streams = 3 + usize::from(p.has_z); // u, delta, (z) in; out
        let per_channel = p.dim * (p.state + usize::from(p.has_d) + usize::from(p.has_delta_bias));
        let states = p.rows() * p.state * (1 + usize::from(p.has_h0));
        4 * (streams * rows_l + 2 * p.bc_len() + per_channel + states) as u64
    }

    fn flops(p: &ScanProblem) -> u64 {
        // Per (b, d, t, n): exp(Δa) (counted as one), Δa, the state update (2) and c·h (2).
        (6 * p.rows() * p.length * p.state) as u64
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        example_inputs(&ScanShape::for_size(size), false, seed)
    }
}

/// `selective_scan_bwd`.
pub struct ScanBwd;

impl OpDef for ScanBwd {
    const NAME: &'static str = "selective_scan_bwd";
    type Problem = ScanProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<ScanProblem> {
        let mut p = check_common(shapes, scalars)?;
        shapes.exact("dout", &[("batch", p.batch), ("dim", p.dim), ("length", p.length)])?;
        p.has_dlast_state =
            shapes.exact_optional("dlast_state", &[("batch", p.batch), ("dim", p.dim), ("state", p.state)])?;
        Ok(p)
    }

    fn reference(p: &ScanProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        let w = Wide::of(inputs);
        let dout = inputs["dout"].data();
        let dlast = inputs.get("dlast_state").map(|t| t.data());
        let (length, n_state) = (p.length, p.state);
        let rows_l = p.rows() * length;
        let (mut du, mut ddelta, mut dz) = (vec![0.0; rows_l], vec![0.0; rows_l], vec![0.0; rows_l]);
        let mut da = vec![0.0; p.dim * n_state];
        let (mut db, mut dc) = (vec![0.0; p.bc_len()], vec![0.0; p.bc_len()]);
        let (mut dd, mut ddelta_bias) = (vec![0.0; p.dim], vec![0.0; p.dim]);
        let mut dh0 = vec![0.0; p.rows() * n_state];
        for batch in 0..p.batch {
            for channel in 0..p.dim {
                let row = batch * p.dim + channel;
                let group = channel / p.channels_per_group();
                let bc_row = |n: usize| ((batch * p.groups + group) * n_state + n) * length;
                let bias = w.delta_bias.map_or(0.0, |v| v[channel]);
                let skip = w.d.map_or(0.0, |v| v[channel]);
                let r = forward_row(p, &w, batch, channel);
                // carry[n] = ā_{t+1}·dh_{t+1}: the gradient reaching h_t from the future.
                let mut carry: Vec<f64> =
                    dlast.map_or(vec![0.0; n_state], |v| v[row * n_state..(row + 1) * n_state].to_vec());
                for t in (0..length).rev() {
                    let index = row * length + t;
                    let (u, step) = (w.u[index], r.steps[t]);
                    let g = match w.z {
                        Some(z) => {
                            dz[index] = dout[index] * r.y[t] * silu_derivative(z[index]);
                            dout[index] * silu(z[index])
                        }
                        None => dout[index],
                    };
                    let mut du_t = skip * g;
                    let mut dstep = 0.0;
                    for n in 0..n_state {
                        let a = w.a[channel * n_state + n];
                        let decay = (step * a).exp();
                        let (b, c) = (w.b[bc_row(n) + t], w.c[bc_row(n) + t]);
                        let h_prev = r.states[t * n_state + n];
                        let h = r.states[(t + 1) * n_state + n];
                        let dh = carry[n] + g * c;
                        du_t += step * dh * b;
                        dstep += dh * (b * u + a * decay * h_prev);
                        da[channel * n_state + n] += dh * step * decay * h_prev;
                        db[bc_row(n) + t] += dh * step * u;
                        dc[bc_row(n) + t] += g * h;
                        carry[n] = decay * dh;
                    }
                    du[index] = du_t;
                    dd[channel] += g * u;
                    let raw = w.delta[index] + bias;
                    let ddelta_t = if p.delta_softplus { dstep * softplus_derivative(raw) } else { dstep };
                    ddelta[index] = ddelta_t;
                    ddelta_bias[channel] += ddelta_t;
                }
                dh0[row * n_state..(row + 1) * n_state].copy_from_slice(&carry);
            }
        }
        let rows_shape = vec![p.batch, p.dim, length];
        let bc_shape = vec![p.batch, p.groups, n_state, length];
        let mut out = TensorMap::new();
        out.insert("du".into(), Tensor::from_parts(rows_shape.clone(), du));
        out.insert("ddelta".into(), Tensor::from_parts(rows_shape.clone(), ddelta));
        out.insert("da".into(), Tensor::from_parts(vec![p.dim, n_state], da));
        out.insert("db".into(), Tensor::from_parts(bc_shape.clone(), db));
        out.insert("dc".into(), Tensor::from_parts(bc_shape, dc));
        if p.has_d {
            out.insert("dd".into(), Tensor::from_parts(vec![p.dim], dd));
        }
        if p.has_z {
            out.insert("dz".into(), Tensor::from_parts(rows_shape, dz));
        }
        if p.has_delta_bias {
            out.insert("ddelta_bias".into(), Tensor::from_parts(vec![p.dim], ddelta_bias));
        }
        if p.has_h0 {
            out.insert("dh0".into(), Tensor::from_parts(vec![p.batch, p.dim, n_state], dh0));
        }
        out
    }

    fn record(p: &ScanProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        check_device_limits(Self::NAME, p)?;
        let op = Self::NAME;
        let mut recorded = Recorded::default();
        let chunks = p.chunks(BWD_CHUNK_LEN);
        let rows_shape = vec![p.batch, p.dim, p.length];
        let bc_shape = vec![p.batch, p.groups, p.state, p.length];
        let mut push = ScanBwdPush {
            u: slot(inputs, op, "u")?,
            delta: slot(inputs, op, "delta")?,
            a: slot(inputs, op, "a")?,
            b: slot(inputs, op, "b")?,
            c: slot(inputs, op, "c")?,
            d: optional_slot(inputs, "d"),
            z: optional_slot(inputs, "z"),
            delta_bias: optional_slot(inputs, "delta_bias"),
            h0: optional_slot(inputs, "h0"),
            dout: slot(inputs, op, "dout")?,
            dlast_state: optional_slot(inputs, "dlast_state"),
            chunk_state: NO_BUFFER,
            chunk_adjoint: NO_BUFFER,
            snapshots: NO_BUFFER,
            du: NO_BUFFER,
            ddelta: NO_BUFFER,
            dz: NO_BUFFER,
            dh0: NO_BUFFER,
            da_partial: NO_BUFFER,
            dd_partial: NO_BUFFER,
            ddelta_bias_partial: NO_BUFFER,
            db: NO_BUFFER,
            dc: NO_BUFFER,
            batch: p.batch as u32,
            dim: p.dim as u32,
            state: p.state as u32,
            groups: p.groups as u32,
            length: p.length as u32,
            chunk_len: BWD_CHUNK_LEN as u32,
            chunks: chunks as u32,
            delta_softplus: u32::from(p.delta_softplus),
        };
        push.du = recorded.output(gpu, op, "du", rows_shape.clone())?;
        push.ddelta = recorded.output(gpu, op, "ddelta", rows_shape.clone())?;
        let da = recorded.output(gpu, op, "da", vec![p.dim, p.state])?;
        let db = recorded.output(gpu, op, "db", bc_shape.clone())?;
        let dc = recorded.output(gpu, op, "dc", bc_shape)?;
        let dd = if p.has_d { Some(recorded.output(gpu, op, "dd", vec![p.dim])?) } else { None };
        if p.has_z {
            push.dz = recorded.output(gpu, op, "dz", rows_shape)?;
        }
        let ddelta_bias =
            if p.has_delta_bias { Some(recorded.output(gpu, op, "ddelta_bias", vec![p.dim])?) } else { None };
        if p.has_h0 {
            push.dh0 = recorded.output(gpu, op, "dh0", vec![p.batch, p.dim, p.state])?;
        }

        // The chunk pass (over every chunk) gives the chunk states and adjoints the combine chains,
        // and the local states at the 16-step boundaries inside each chunk; with one chunk of at
        // most 16 steps there is nothing to give.
        if chunks > 1 || p.length > BWD_SUB_STEPS {
            let mut chunk_push = fwd_push(p, inputs, op, BWD_CHUNK_LEN)?;
            chunk_push.dout = push.dout;
            chunk_push.dlast_state = push.dlast_state;
            chunk_push.chunk_dsum = recorded.scratch(gpu, op, "chunk delta sums", p.rows() * chunks)?;
            if chunks > 1 {
                chunk_push.chunk_state = recorded.scratch(gpu, op, "chunk states", p.rows() * chunks * p.state)?;
                chunk_push.chunk_adjoint = recorded.scratch(gpu, op, "chunk adjoints", p.rows() * chunks * p.state)?;
            }
            if p.length > BWD_SUB_STEPS {
                let boundaries = BWD_CHUNK_LEN / BWD_SUB_STEPS - 1;
                let elements = p.batch * chunks * boundaries * (p.state + 1) * p.dim;
                chunk_push.snapshots = recorded.scratch(gpu, op, "sub-chunk snapshots", elements)?;
            }
            chunk_push.grid_chunks = chunks as u32;
            let kernel = kernels::selective_scan_fwd::SELECTIVE_SCAN_CHUNK_STATE_ADJOINT;
            recorded.dispatches.push(Dispatch::linear(kernel, p.walk_workgroups(chunks, FWD_LANES), &chunk_push)?);
            if chunks > 1 {
                record_combine(&mut recorded, p, &chunk_push)?;
            }
            push.chunk_state = chunk_push.chunk_state;
            push.chunk_adjoint = chunk_push.chunk_adjoint;
            push.snapshots = chunk_push.snapshots;
        }
        let partial_rows = p.batch * chunks;
        push.da_partial = recorded.scratch(gpu, op, "da partials", partial_rows * p.dim * p.state)?;
        if p.has_d {
            push.dd_partial = recorded.scratch(gpu, op, "dd partials", partial_rows * p.dim)?;
        }
        if p.has_delta_bias {
            push.ddelta_bias_partial = recorded.scratch(gpu, op, "ddelta_bias partials", partial_rows * p.dim)?;
        }
        let blocks = p.channel_blocks(BWD_LANES);
        if blocks == 1 {
            push.db = db;
            push.dc = dc;
        } else {
            push.db = recorded.scratch(gpu, op, "db channel-block partials", blocks * p.bc_len())?;
            push.dc = recorded.scratch(gpu, op, "dc channel-block partials", blocks * p.bc_len())?;
        }
        let kernel = kernels::selective_scan_bwd::SELECTIVE_SCAN_BWD_CHUNK;
        recorded.dispatches.push(Dispatch::linear(kernel, p.walk_workgroups(chunks, BWD_LANES), &push)?);

        if blocks > 1 {
            let reduce = ScanReducePush {
                db_partial: push.db,
                dc_partial: push.dc,
                db,
                dc,
                rows: blocks as u32,
                cols: p.bc_len() as u32,
            };
            let kernel = kernels::selective_scan_reduce::SELECTIVE_SCAN_CHANNEL_SUM;
            let workgroups = p.bc_len().div_ceil(LINEAR_WORKGROUP) as u64;
            recorded.dispatches.push(Dispatch::linear(kernel, workgroups, &reduce)?);
        }
        let partials =
            |slot: u32, cols: usize| Partials { slot, rows: partial_rows, cols, offset: 0, row_stride: cols };
        column_sums(&mut recorded, gpu, op, partials(push.da_partial, p.dim * p.state), da)?;
        if let Some(dd) = dd {
            column_sums(&mut recorded, gpu, op, partials(push.dd_partial, p.dim), dd)?;
        }
        if let Some(ddelta_bias) = ddelta_bias {
            column_sums(&mut recorded, gpu, op, partials(push.ddelta_bias_partial, p.dim), ddelta_bias)?;
        }
        Ok(recorded)
    }

    fn traffic_bytes(p: &ScanProblem) -> u64 {
        let rows_l = p.rows() * p.length;
        // In: u, delta, dout, (z); out: du, ddelta, (dz).
        let streams = 5 + 2 * usize::from(p.has_z);
        let per_channel = 2 * p.dim * (p.state + usize::from(p.has_d) + usize::from(p.has_delta_bias));
        let states = p.rows() * p.state * (2 * usize::from(p.has_h0) + usize::from(p.has_dlast_state));
        4 * (streams * rows_l + 4 * p.bc_len() + per_channel + states) as u64
    }

    fn flops(p: &ScanProblem) -> u64 {
        // Per (b, d, t, n): the forward recomputation (6) and the adjoint: dh (2), du and ddelta
        // terms (6), da (3), db (2), dc (1).
        (20 * p.rows() * p.length * p.state) as u64
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        example_inputs(&ScanShape::for_size(size), true, seed)
    }

    /// The small example, and one whose groups span several channel blocks (the db/dc block sum).
    fn coverage_examples(seed: u64) -> Vec<(TensorMap, Scalars)> {
        let blocks = ScanShape { dim: 2 * BWD_LANES + 3, ..ScanShape::for_size(ExampleSize::Small) };
        vec![Self::example(ExampleSize::Small, seed), example_inputs(&blocks, true, seed)]
    }
}

/// Sizes the kernels index with 32-bit arithmetic (every buffer is within the device's limit, which
/// is below 4 GiB; these are the few products that are not a buffer's size).
fn check_device_limits(op: &str, p: &ScanProblem) -> Result<()> {
    let workgroups = p.walk_workgroups(p.chunks(BWD_CHUNK_LEN.min(FWD_CHUNK_LEN)), BWD_LANES.min(FWD_LANES));
    if workgroups > u64::from(crate::gpu::GRID_X) * 65535 {
        return Err(Error::unsupported(op, format!("{workgroups} workgroups exceed the grid limit")));
    }
    let combine_lanes = (p.rows() * p.state) as u64;
    if combine_lanes >= 1 << 32 {
        return Err(Error::unsupported(op, format!("{combine_lanes} (b, d, n) lanes exceed 32-bit indexing")));
    }
    Ok(())
}

fn fwd_push(p: &ScanProblem, inputs: &GpuTensors, op: &str, chunk_len: usize) -> Result<ScanFwdPush> {
    Ok(ScanFwdPush {
        u: slot(inputs, op, "u")?,
        delta: slot(inputs, op, "delta")?,
        a: slot(inputs, op, "a")?,
        b: slot(inputs, op, "b")?,
        c: slot(inputs, op, "c")?,
        d: optional_slot(inputs, "d"),
        z: optional_slot(inputs, "z"),
        delta_bias: optional_slot(inputs, "delta_bias"),
        h0: optional_slot(inputs, "h0"),
        out: NO_BUFFER,
        last_state: NO_BUFFER,
        chunk_state: NO_BUFFER,
        chunk_dsum: NO_BUFFER,
        dout: NO_BUFFER,
        chunk_adjoint: NO_BUFFER,
        dlast_state: NO_BUFFER,
        snapshots: NO_BUFFER,
        batch: p.batch as u32,
        dim: p.dim as u32,
        state: p.state as u32,
        groups: p.groups as u32,
        length: p.length as u32,
        chunk_len: chunk_len as u32,
        chunks: p.chunks(chunk_len) as u32,
        grid_chunks: 0,
        delta_softplus: u32::from(p.delta_softplus),
    })
}

/// Passes 1 and 2 of the forward: the chunk walk over every chunk but the last, then the combine.
fn record_chunk_passes(recorded: &mut Recorded, p: &ScanProblem, mut push: ScanFwdPush) -> Result<()> {
    let grid_chunks = p.chunks(FWD_CHUNK_LEN) - 1;
    push.grid_chunks = grid_chunks as u32;
    let kernel = kernels::selective_scan_fwd::SELECTIVE_SCAN_CHUNK_STATE;
    recorded.dispatches.push(Dispatch::linear(kernel, p.walk_workgroups(grid_chunks, FWD_LANES), &push)?);
    record_combine(recorded, p, &push)
}

/// The per-(b, d, n) chain of chunk states (and adjoints, when given).
fn record_combine(recorded: &mut Recorded, p: &ScanProblem, push: &ScanFwdPush) -> Result<()> {
    let kernel = kernels::selective_scan_fwd::SELECTIVE_SCAN_CHUNK_COMBINE;
    let workgroups = (p.rows() * p.state).div_ceil(LINEAR_WORKGROUP) as u64;
    recorded.dispatches.push(Dispatch::linear(kernel, workgroups, push)?);
    Ok(())
}

/// The sizes and options of one test or benchmark case.
#[derive(Clone, Debug)]
pub struct ScanShape {
    pub batch: usize,
    pub dim: usize,
    pub state: usize,
    pub groups: usize,
    pub length: usize,
    pub d: bool,
    pub z: bool,
    pub delta_bias: bool,
    pub h0: bool,
    /// Backward only.
    pub dlast_state: bool,
    pub delta_softplus: bool,
}

impl ScanShape {
    /// Every optional input on.
    pub fn full(batch: usize, dim: usize, state: usize, groups: usize, length: usize) -> Self {
        ScanShape {
            batch,
            dim,
            state,
            groups,
            length,
            d: true,
            z: true,
            delta_bias: true,
            h0: true,
            dlast_state: true,
            delta_softplus: true,
        }
    }

    /// The benchmark of the issue on a GPU (B=8, D=2048, N=16, L=2048, G=1, with z, d, delta_bias
    /// and softplus); a scaled-down one for a CPU device; a tiny one for quick checks.
    pub fn for_size(size: ExampleSize) -> Self {
        let (batch, dim, length) = match size {
            ExampleSize::Small => (1, 8, 300), // three chunks: every pass runs
            ExampleSize::CpuDevice => (2, 128, 1024),
            ExampleSize::Gpu => (8, 2048, 2048),
        };
        ScanShape { h0: false, dlast_state: false, ..Self::full(batch, dim, 16, 1, length) }
    }
}

/// Random inputs like the official tests': u, b, c, z, dout ~ N(0, 1); delta ~ 0.5·U[0, 1);
/// delta_bias ~ 0.5·U[0, 1) (so Δ > 0 without softplus too); a negative: −0.5·U[0.1, 1) on even
/// channels, the S4D-real −(n + 1) on odd ones; d ~ N(0, 1); h0, dlast_state ~ N(0, 1).
pub fn example_inputs(shape: &ScanShape, backward: bool, seed: u64) -> (TensorMap, Scalars) {
    let s = shape;
    let mut rng = Rng::new(seed);
    let rows_shape = vec![s.batch, s.dim, s.length];
    let bc_shape = vec![s.batch, s.groups, s.state, s.length];
    let mut inputs = TensorMap::new();
    inputs.insert("u".into(), rng.normal_tensor(rows_shape.clone(), 1.0));
    inputs.insert("delta".into(), rng.uniform_tensor(rows_shape.clone(), 0.0, 0.5));
    let a = Tensor::from_fn(vec![s.dim, s.state], |i| {
        let (channel, n) = (i / s.state, i % s.state);
        let value = if channel % 2 == 0 { -0.5 * rng.uniform(0.1, 1.0) } else { -((n + 1) as f64) };
        value as f32
    });
    inputs.insert("a".into(), a);
    inputs.insert("b".into(), rng.normal_tensor(bc_shape.clone(), 1.0));
    inputs.insert("c".into(), rng.normal_tensor(bc_shape, 1.0));
    if s.d {
        inputs.insert("d".into(), rng.normal_tensor(vec![s.dim], 1.0));
    }
    if s.z {
        inputs.insert("z".into(), rng.normal_tensor(rows_shape.clone(), 1.0));
    }
    if s.delta_bias {
        inputs.insert("delta_bias".into(), rng.uniform_tensor(vec![s.dim], 0.0, 0.5));
    }
    if s.h0 {
        inputs.insert("h0".into(), rng.normal_tensor(vec![s.batch, s.dim, s.state], 1.0));
    }
    if backward {
        inputs.insert("dout".into(), rng.normal_tensor(rows_shape, 1.0));
        if s.dlast_state {
            inputs.insert("dlast_state".into(), rng.normal_tensor(vec![s.batch, s.dim, s.state], 1.0));
        }
    }
    let scalars = Scalars::new().with("delta_softplus", u32::from(s.delta_softplus));
    (inputs, scalars)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{finite_difference_error, weighted_sum};

    #[test]
    fn push_layouts_match_reflection() {
        crate::gpu::check_push_layout::<ScanFwdPush>(kernels::selective_scan_fwd::FILE).unwrap();
        crate::gpu::check_push_layout::<ScanBwdPush>(kernels::selective_scan_bwd::FILE).unwrap();
        crate::gpu::check_push_layout::<ScanReducePush>(kernels::selective_scan_reduce::FILE).unwrap();
    }

    fn problem_of(s: &ScanShape) -> ScanProblem {
        ScanProblem {
            batch: s.batch,
            dim: s.dim,
            state: s.state,
            groups: s.groups,
            length: s.length,
            has_d: s.d,
            has_z: s.z,
            has_delta_bias: s.delta_bias,
            has_h0: s.h0,
            has_dlast_state: s.dlast_state,
            delta_softplus: s.delta_softplus,
        }
    }

    /// loss = Σ dout·out + Σ dlast_state·last_state; every differentiable input is perturbed.
    #[test]
    fn reference_backward_matches_finite_differences() {
        let mut cases = vec![ScanShape::full(2, 4, 3, 2, 5), ScanShape::full(1, 2, 2, 1, 1)];
        let mut bare = ScanShape::full(1, 3, 2, 1, 6);
        (bare.d, bare.z, bare.delta_bias, bare.h0, bare.dlast_state, bare.delta_softplus) =
            (false, false, false, false, false, false);
        cases.push(bare);
        let mut mixed = ScanShape::full(2, 4, 2, 2, 4);
        (mixed.z, mixed.delta_softplus, mixed.dlast_state) = (false, false, false);
        cases.push(mixed);
        for (i, shape) in cases.iter().enumerate() {
            let p = problem_of(shape);
            let (inputs, _) = example_inputs(shape, true, 40 + i as u64);
            let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
            let mut weights = TensorMap::new();
            weights.insert("out".to_string(), wide["dout"].clone());
            if let Some(dlast) = wide.get("dlast_state") {
                weights.insert("last_state".to_string(), dlast.clone());
            }
            let loss = |x: &TensorMap<f64>| weighted_sum(&ScanFwd::reference(&p, x), &weights);
            let grads = ScanBwd::reference(&p, &wide);
            let mut names = vec!["u", "delta", "a", "b", "c"];
            for (given, name) in [(shape.d, "d"), (shape.z, "z"), (shape.delta_bias, "delta_bias"), (shape.h0, "h0")] {
                if given {
                    names.push(name);
                }
            }
            let (error, at) = finite_difference_error(&loss, &wide, &grads, &names, 200, 1e-6);
            assert!(error < 1e-6, "{shape:?}: {error:e} at {at}");
        }
    }
}
