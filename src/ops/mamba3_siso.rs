//! `mamba3_siso_fwd` / `mamba3_siso_bwd`: the single-input single-output Mamba-3 scan
//! (spec/mamba.md §4.3, §4.6, §4.9; spec/ops.md).
//!
//! The reference is the sequential recurrence in f64: per (b, h), with g = h / (H/G),
//! θ_t = θ_{t−1} + π·tanh(angles_t)·dt_t (accumulated without wrapping, wrapped only before cos/sin),
//! q̃_t = R(θ_t)(q_t + q_bias), k̃_t = R(θ_t)(k_t + k_bias), α = exp(adt), λ = σ(trap), γ = λ·dt,
//! β = (1 − λ)·dt·α, h_t = α h_{t−1} + β v_{t−1}k̃_{t−1}ᵀ + γ v_t k̃_tᵀ, y_t = h_t q̃_t + d·v_t,
//! out_t = y_t·silu(z_t).
//!
//! The GPU kernels use the chunked shifted-state form (S_t = h_t + μ_{t+1} v_t k̃_tᵀ, a plain SSM
//! with input weight scale_t = γ_t + μ_{t+1} and an explicit diagonal term γ_t (q_t·k_t) v_t),
//! split into passes that are parallel over (batch, head, chunk):
//!
//! forward: `prep` (per chunk: local cumulative decay, scale, γ, local angle cumsum) →
//! `angle_pass` (per (b, h): angle prefix over chunks, final angle / k / v states) → `rotation`
//! (per step and pair: the (cos θ, sin θ) table every chunk kernel reads) → `chunk_state` (per
//! chunk: S_loc = Σ_j w_j v_j k̃_jᵀ) → `state_pass` (per (b, h) and state element:
//! S_in[c+1] = exp(A_c)·S_in[c] + S_loc[c], in place) → `chunk_fwd` (per chunk: inter-chunk term,
//! masked intra-chunk term, diagonal, D, gate). Where B·H·tiles workgroups fill the GPU
//! (`StatePassing`), `state_scan` replaces `chunk_state` and `state_pass`: a workgroup per
//! (b, h, state tile) walks the chunks with the running state in registers, so the local states
//! never go through memory (and `dstate_scan` the gradient pair). On Vulkan, where every tile and
//! chunk is regular, the walks take their loader-warp form (`state_scan_ws`, `loader_walks`).
//!
//! backward: the forward's first five passes again (states entering every chunk), then `chunk_state`
//! in gradient mode (dS_loc = Σ_t exp(A_t) g_t q̃_tᵀ) and `state_pass` in reverse (gradient of the
//! state leaving every chunk); `chunk_bwd` (per chunk: recomputed output, dz, dv, dadt through an
//! in-chunk reverse cumsum, dscale, dγ, dD partials); `dqk` (per chunk and group, looping over the
//! heads of the group in order: dq, dk, the angle gradient per step and per-chunk bias partials);
//! `angle_suffix` (per (b, h): suffix sums of the angle gradient over chunks); `state_grads`
//! (input-state gradients); `tail` (per chunk: dangles, ddt, dtrap). Sums over batch and time
//! (dq_bias, dk_bias, dd) go through `column_sums`. Nothing uses atomics; every sum has an order
//! fixed by the shapes alone.

use std::f64::consts::{PI, TAU};

use crate::backend::Device;
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, MatrixPath, StatePassing, NO_BUFFER};
use crate::kernels::{self, KernelRef};
use crate::ops::math::{sigmoid, silu, silu_derivative, wrap_angle};
use crate::ops::reduce::{column_sums, Partials};
use crate::ops::{optional_slot, slot, ExampleSize, GpuTensors, OpDef, Recorded, ScalarCheck, ShapeCheck};
use crate::push_constants;
use crate::random::Rng;
use crate::tensor::{Scalars, Tensor, TensorMap};

/// The largest chunk the kernels take: one chunk is one 64-row tile.
pub const MAX_CHUNK: usize = 64;

/// The four optional input states, in the order of spec/ops.md.
pub const INPUT_STATES: [&str; 4] = ["angle_state", "ssm_state", "k_state", "v_state"];
/// The four final states the forward returns.
pub const FINAL_STATES: [&str; 4] = ["final_angle_state", "final_ssm_state", "final_k_state", "final_v_state"];

/// Validated sizes and options of one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SisoProblem {
    /// B
    pub batch: usize,
    /// L
    pub length: usize,
    /// H
    pub heads: usize,
    /// G
    pub groups: usize,
    /// N (even)
    pub state: usize,
    /// P
    pub head_dim: usize,
    /// S (≤ N/2)
    pub rope: usize,
    /// Q
    pub chunk: usize,
    pub has_d: bool,
    pub has_z: bool,
    pub has_states: bool,
    /// Backward only: which final-state gradients were given.
    pub has_dfinal: [bool; 4],
    /// Forward only: also return `chunk_states` and, with z, `ungated_out` (scalar
    /// `save_for_backward`).
    pub save_for_backward: bool,
    /// Backward only: `chunk_states` from the forward was given, so the states entering the
    /// chunks are read instead of recomputed.
    pub has_chunk_states: bool,
    /// Backward only: `ungated_out` (the forward's y before the gate) was given, so the chunk
    /// kernel reads y instead of recomputing it.
    pub has_ungated_out: bool,
}

impl SisoProblem {
    pub fn chunks(&self) -> usize {
        self.length.div_ceil(self.chunk)
    }

    fn heads_per_group(&self) -> usize {
        self.heads / self.groups
    }
}

fn check_common(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<SisoProblem> {
    let q = shapes.required("q", &["B", "L", "G", "N"])?;
    let (batch, length, groups, state) = (q[0], q[1], q[2], q[3]);
    shapes.exact("k", &[("B", batch), ("L", length), ("G", groups), ("N", state)])?;
    let v = shapes.required("v", &["B", "L", "H", "P"])?;
    if v[0] != batch || v[1] != length {
        return Err(
            shapes.error("v", format!("expected shape [B={batch}, L={length}, H, P] (B and L of `q`), got {v:?}"))
        );
    }
    let (heads, head_dim) = (v[2], v[3]);
    if heads % groups != 0 {
        return Err(shapes.error(
            "v",
            format!(
                "the head count H={heads} (axis 2) must be a multiple of the group count G={groups} of `q` \
                 (head h reads group h / (H/G))"
            ),
        ));
    }
    if state % 2 != 0 {
        return Err(shapes.error(
            "q",
            format!("the state size N={state} (axis 3) must be even (rotated pairs are (2i, 2i+1)), got shape {q:?}"),
        ));
    }
    for name in ["adt", "dt", "trap"] {
        shapes.exact(name, &[("B", batch), ("H", heads), ("L", length)])?;
    }
    shapes.exact("q_bias", &[("H", heads), ("N", state)])?;
    shapes.exact("k_bias", &[("H", heads), ("N", state)])?;
    let angles = shapes.required("angles", &["B", "L", "H", "S"])?;
    if angles[..3] != [batch, length, heads] {
        return Err(
            shapes.error("angles", format!("expected shape [B={batch}, L={length}, H={heads}, S], got {angles:?}"))
        );
    }
    let rope = angles[3];
    if 2 * rope > state {
        return Err(shapes.error(
            "angles",
            format!("the angle count S={rope} (axis 3) must be at most N/2 = {} (N={state})", state / 2),
        ));
    }
    let has_d = shapes.exact_optional("d", &[("H", heads)])?;
    let has_z = shapes.exact_optional("z", &[("B", batch), ("L", length), ("H", heads), ("P", head_dim)])?;
    let given = [
        shapes.exact_optional("angle_state", &[("B", batch), ("H", heads), ("S", rope)])?,
        shapes.exact_optional("ssm_state", &[("B", batch), ("H", heads), ("P", head_dim), ("N", state)])?,
        shapes.exact_optional("k_state", &[("B", batch), ("H", heads), ("N", state)])?,
        shapes.exact_optional("v_state", &[("B", batch), ("H", heads), ("P", head_dim)])?,
    ];
    let has_states = given.iter().all(|&g| g);
    if !has_states && given.iter().any(|&g| g) {
        let present: Vec<&str> = INPUT_STATES.iter().zip(given).filter(|(_, g)| *g).map(|(n, _)| *n).collect();
        let absent: Vec<&str> = INPUT_STATES.iter().zip(given).filter(|(_, g)| !*g).map(|(n, _)| *n).collect();
        return Err(shapes.error(
            absent[0],
            format!(
                "the four input states come together: given {present:?}, missing {absent:?} \
                 (pass all of angle_state, ssm_state, k_state, v_state or none)"
            ),
        ));
    }
    let chunk = scalars.u32_or("chunk_size", 64)? as usize;
    if chunk == 0 || chunk > MAX_CHUNK {
        return Err(scalars.error("chunk_size", format!("must be between 1 and {MAX_CHUNK}, got {chunk}")));
    }
    Ok(SisoProblem {
        batch,
        length,
        heads,
        groups,
        state,
        head_dim,
        rope,
        chunk,
        has_d,
        has_z,
        has_states,
        has_dfinal: [false; 4],
        save_for_backward: false,
        has_chunk_states: false,
        has_ungated_out: false,
    })
}

/// The name of the states entering every chunk, which the forward returns when asked
/// (`save_for_backward`) and the backward takes instead of recomputing them.
pub const CHUNK_STATES: &str = "chunk_states";
/// The name of y before the gate, y_t = h_t q̃_t + d·v_t, which the forward returns when asked
/// and z is given (without z it is `out`), and the backward takes instead of recomputing it.
pub const UNGATED_OUT: &str = "ungated_out";

/// Backward inputs with what the forward saves for it added (`chunk_states`, and `ungated_out`:
/// the forward's own with z, its `out` without): runs `mamba3_siso_fwd` on `device` with
/// `save_for_backward` = 1 on the forward's part of `inputs` (benchmarks and tools; a training
/// step keeps the forward's outputs instead).
pub fn with_saved_forward(device: &Device, inputs: &TensorMap, scalars: &Scalars) -> Result<TensorMap> {
    let forward_inputs: TensorMap = inputs
        .iter()
        .filter(|(name, _)| name.as_str() != "dout" && !DFINAL.contains(&name.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let saving = scalars.clone().with("save_for_backward", 1);
    let mut forward = crate::ops::run(device, SisoFwd::NAME, &forward_inputs, &saving)?;
    let mut result = inputs.clone();
    if let Some(states) = forward.remove(CHUNK_STATES) {
        result.insert(CHUNK_STATES.into(), states);
    }
    if let Some(ungated) = forward.remove(UNGATED_OUT).or_else(|| forward.remove("out")) {
        result.insert(UNGATED_OUT.into(), ungated);
    }
    Ok(result)
}

/// The shape of `chunk_states`: [B, H, chunks, P, N].
fn chunk_states_dims(p: &SisoProblem) -> [(&'static str, usize); 5] {
    [("B", p.batch), ("H", p.heads), ("chunks", p.chunks()), ("P", p.head_dim), ("N", p.state)]
}

fn chunk_states_shape(p: &SisoProblem) -> Vec<usize> {
    chunk_states_dims(p).iter().map(|d| d.1).collect()
}

// ------------------------------------------------------------------------------------------------
// f64 reference
// ------------------------------------------------------------------------------------------------

/// Views of the inputs of one call, in f64.
struct Inputs<'a> {
    p: &'a SisoProblem,
    q: &'a [f64],
    k: &'a [f64],
    v: &'a [f64],
    adt: &'a [f64],
    dt: &'a [f64],
    trap: &'a [f64],
    q_bias: &'a [f64],
    k_bias: &'a [f64],
    angles: &'a [f64],
    d: Option<&'a [f64]>,
    z: Option<&'a [f64]>,
    states: Option<[&'a [f64]; 4]>,
}

impl<'a> Inputs<'a> {
    fn new(p: &'a SisoProblem, inputs: &'a TensorMap<f64>) -> Self {
        let get = |name: &str| inputs[name].data();
        Inputs {
            p,
            q: get("q"),
            k: get("k"),
            v: get("v"),
            adt: get("adt"),
            dt: get("dt"),
            trap: get("trap"),
            q_bias: get("q_bias"),
            k_bias: get("k_bias"),
            angles: get("angles"),
            d: inputs.get("d").map(|t| t.data()),
            z: inputs.get("z").map(|t| t.data()),
            states: p.has_states.then(|| INPUT_STATES.map(|name| inputs[name].data())),
        }
    }

    /// Index of (b, h, t) in [B, H, L] tensors.
    fn bht(&self, b: usize, h: usize, t: usize) -> usize {
        (b * self.p.heads + h) * self.p.length + t
    }

    /// Offset of row (b, t, h) in [B, L, H, X] tensors of width `x`.
    fn blh(&self, b: usize, t: usize, h: usize, x: usize) -> usize {
        ((b * self.p.length + t) * self.p.heads + h) * x
    }

    /// Offset of row (b, t, g) in [B, L, G, N].
    fn blg(&self, b: usize, t: usize, g: usize) -> usize {
        ((b * self.p.length + t) * self.p.groups + g) * self.p.state
    }
}

/// Rotates the pairs (2i, 2i+1), i < S, of `u` by `angles[i]`, in place.
fn rotate(u: &mut [f64], angles: &[f64]) {
    for (i, &theta) in angles.iter().enumerate() {
        let wrapped = wrap_angle(theta);
        let (s, c) = wrapped.sin_cos();
        let (u0, u1) = (u[2 * i], u[2 * i + 1]);
        u[2 * i] = u0 * c - u1 * s;
        u[2 * i + 1] = u0 * s + u1 * c;
    }
}

/// The per-step quantities of one (b, h) sequence that the backward reuses.
struct Trace {
    /// θ_t, unwrapped, [L, S]
    theta: Vec<f64>,
    /// un-rotated biased q_t and k_t, [L, N]
    q_raw: Vec<f64>,
    k_raw: Vec<f64>,
    /// rotated q̃_t, k̃_t, [L, N]
    q_rot: Vec<f64>,
    k_rot: Vec<f64>,
    /// h_t, [L, P, N]
    h: Vec<f64>,
    /// y_t before the gate, [L, P]
    y: Vec<f64>,
    /// the state entering each chunk in the kernels' shifted form, [chunks, P, N] (when asked)
    chunk_states: Vec<f64>,
    /// final θ (unwrapped), h, k̃ and v
    final_theta: Vec<f64>,
    final_h: Vec<f64>,
    final_k: Vec<f64>,
    final_v: Vec<f64>,
}

/// Runs the sequential recurrence of one (b, h) and writes `out` rows, and y before the gate into
/// `ungated` when it is not empty (the same layout as `out`).
fn forward_sequence(x: &Inputs, b: usize, h: usize, out: &mut [f64], ungated: &mut [f64], keep: bool) -> Trace {
    let p = x.p;
    let (n, pd, s) = (p.state, p.head_dim, p.rope);
    let g = h / p.heads_per_group();
    let mut theta = vec![0.0; s];
    let mut state = vec![0.0; pd * n];
    let mut k_prev = vec![0.0; n];
    let mut v_prev = vec![0.0; pd];
    if let Some(st) = &x.states {
        theta.copy_from_slice(&st[0][(b * p.heads + h) * s..][..s]);
        state.copy_from_slice(&st[1][(b * p.heads + h) * pd * n..][..pd * n]);
        k_prev.copy_from_slice(&st[2][(b * p.heads + h) * n..][..n]);
        v_prev.copy_from_slice(&st[3][(b * p.heads + h) * pd..][..pd]);
    }
    let d = x.d.map_or(0.0, |d| d[h]);
    let cap = if keep { p.length } else { 0 };
    let mut trace = Trace {
        theta: Vec::with_capacity(cap * s),
        q_raw: Vec::with_capacity(cap * n),
        k_raw: Vec::with_capacity(cap * n),
        q_rot: Vec::with_capacity(cap * n),
        k_rot: Vec::with_capacity(cap * n),
        h: Vec::with_capacity(cap * pd * n),
        y: Vec::with_capacity(cap * pd),
        chunk_states: Vec::new(),
        final_theta: Vec::new(),
        final_h: Vec::new(),
        final_k: Vec::new(),
        final_v: Vec::new(),
    };
    for t in 0..p.length {
        let i = x.bht(b, h, t);
        let (adt, dt, lambda) = (x.adt[i], x.dt[i], sigmoid(x.trap[i]));
        if p.save_for_backward && t % p.chunk == 0 {
            // S = h_{t−1} + μ_t·v_{t−1}k̃_{t−1}ᵀ with μ_t = (1 − λ_t)·dt_t: the state entering the
            // chunk in the shifted form the kernels carry (S_t = α_t·S_{t−1} + scale_t·v_t k̃_tᵀ)
            let mu = (1.0 - lambda) * dt;
            for a in 0..pd {
                trace.chunk_states.extend((0..n).map(|j| state[a * n + j] + mu * v_prev[a] * k_prev[j]));
            }
        }
        let arow = &x.angles[x.blh(b, t, h, s)..][..s];
        for (th, &a) in theta.iter_mut().zip(arow) {
            *th += PI * a.tanh() * dt;
        }
        let q_raw: Vec<f64> = (0..n).map(|j| x.q[x.blg(b, t, g) + j] + x.q_bias[h * n + j]).collect();
        let k_raw: Vec<f64> = (0..n).map(|j| x.k[x.blg(b, t, g) + j] + x.k_bias[h * n + j]).collect();
        let mut q_rot = q_raw.clone();
        let mut k_rot = k_raw.clone();
        rotate(&mut q_rot, &theta);
        rotate(&mut k_rot, &theta);
        let alpha = adt.exp();
        let gamma = lambda * dt;
        let beta = (1.0 - lambda) * dt * alpha;
        let v = &x.v[x.blh(b, t, h, pd)..][..pd];
        for a in 0..pd {
            for j in 0..n {
                let e = &mut state[a * n + j];
                *e = alpha * *e + beta * v_prev[a] * k_prev[j] + gamma * v[a] * k_rot[j];
            }
        }
        let row = x.blh(b, t, h, pd);
        let mut y = vec![0.0; pd];
        for a in 0..pd {
            y[a] = (0..n).map(|j| state[a * n + j] * q_rot[j]).sum::<f64>() + d * v[a];
            if !ungated.is_empty() {
                ungated[row + a] = y[a];
            }
            out[row + a] = match x.z {
                Some(z) => y[a] * silu(z[row + a]),
                None => y[a],
            };
        }
        k_prev.copy_from_slice(&k_rot);
        v_prev.copy_from_slice(v);
        if keep {
            trace.theta.extend_from_slice(&theta);
            trace.q_raw.extend_from_slice(&q_raw);
            trace.k_raw.extend_from_slice(&k_raw);
            trace.q_rot.extend_from_slice(&q_rot);
            trace.k_rot.extend_from_slice(&k_rot);
            trace.h.extend_from_slice(&state);
            trace.y.extend_from_slice(&y);
        }
    }
    trace.final_theta = theta;
    trace.final_h = state;
    trace.final_k = k_prev;
    trace.final_v = v_prev;
    trace
}

fn tensor(shape: Vec<usize>, data: Vec<f64>) -> Tensor<f64> {
    Tensor::from_parts(shape, data)
}

/// The f64 forward reference: `out` and the four final states.
pub fn reference_forward(p: &SisoProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
    let x = Inputs::new(p, inputs);
    let (n, pd, s) = (p.state, p.head_dim, p.rope);
    let mut out = vec![0.0; p.batch * p.length * p.heads * pd];
    let mut final_angle = vec![0.0; p.batch * p.heads * s];
    let mut final_ssm = vec![0.0; p.batch * p.heads * pd * n];
    let mut final_k = vec![0.0; p.batch * p.heads * n];
    let mut final_v = vec![0.0; p.batch * p.heads * pd];
    let mut chunk_states = Vec::new();
    let mut ungated = vec![0.0; if p.save_for_backward && p.has_z { out.len() } else { 0 }];
    for b in 0..p.batch {
        for h in 0..p.heads {
            let trace = forward_sequence(&x, b, h, &mut out, &mut ungated, false);
            chunk_states.extend_from_slice(&trace.chunk_states);
            let bh = b * p.heads + h;
            for (o, th) in final_angle[bh * s..][..s].iter_mut().zip(&trace.final_theta) {
                *o = wrap_angle(*th);
            }
            final_ssm[bh * pd * n..][..pd * n].copy_from_slice(&trace.final_h);
            final_k[bh * n..][..n].copy_from_slice(&trace.final_k);
            final_v[bh * pd..][..pd].copy_from_slice(&trace.final_v);
        }
    }
    let mut result = TensorMap::new();
    result.insert("out".into(), tensor(vec![p.batch, p.length, p.heads, pd], out));
    result.insert("final_angle_state".into(), tensor(vec![p.batch, p.heads, s], final_angle));
    result.insert("final_ssm_state".into(), tensor(vec![p.batch, p.heads, pd, n], final_ssm));
    result.insert("final_k_state".into(), tensor(vec![p.batch, p.heads, n], final_k));
    result.insert("final_v_state".into(), tensor(vec![p.batch, p.heads, pd], final_v));
    if p.save_for_backward {
        result.insert(CHUNK_STATES.into(), tensor(chunk_states_shape(p), chunk_states));
    }
    if !ungated.is_empty() {
        result.insert(UNGATED_OUT.into(), tensor(vec![p.batch, p.length, p.heads, pd], ungated));
    }
    result
}

/// The f64 backward reference (spec/mamba.md §4.6).
pub fn reference_backward(p: &SisoProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
    let x = Inputs::new(p, inputs);
    let (n, pd, s, l) = (p.state, p.head_dim, p.rope, p.length);
    let dout = inputs["dout"].data();
    let dfinal: [Option<&[f64]>; 4] = ["dfinal_angle_state", "dfinal_ssm_state", "dfinal_k_state", "dfinal_v_state"]
        .map(|name| inputs.get(name).map(|t| t.data()));
    let mut dq = vec![0.0; p.batch * l * p.groups * n];
    let mut dk = vec![0.0; p.batch * l * p.groups * n];
    let mut dv = vec![0.0; p.batch * l * p.heads * pd];
    let mut dz = vec![0.0; if p.has_z { p.batch * l * p.heads * pd } else { 0 }];
    let mut dadt = vec![0.0; p.batch * p.heads * l];
    let mut ddt = vec![0.0; p.batch * p.heads * l];
    let mut dtrap = vec![0.0; p.batch * p.heads * l];
    let mut dq_bias = vec![0.0; p.heads * n];
    let mut dk_bias = vec![0.0; p.heads * n];
    let mut dangles = vec![0.0; p.batch * l * p.heads * s];
    let mut dd = vec![0.0; p.heads];
    let mut dangle_state = vec![0.0; p.batch * p.heads * s];
    let mut dssm_state = vec![0.0; p.batch * p.heads * pd * n];
    let mut dk_state = vec![0.0; p.batch * p.heads * n];
    let mut dv_state = vec![0.0; p.batch * p.heads * pd];
    let mut scratch_out = vec![0.0; p.batch * l * p.heads * pd];
    for b in 0..p.batch {
        for h in 0..p.heads {
            let bh = b * p.heads + h;
            let g = h / p.heads_per_group();
            let tr = forward_sequence(&x, b, h, &mut scratch_out, &mut [], true);
            let d = x.d.map_or(0.0, |d| d[h]);
            let (h_init, k_init, v_init) = match &x.states {
                Some(st) => (
                    st[1][bh * pd * n..][..pd * n].to_vec(),
                    st[2][bh * n..][..n].to_vec(),
                    st[3][bh * pd..][..pd].to_vec(),
                ),
                None => (vec![0.0; pd * n], vec![0.0; n], vec![0.0; pd]),
            };
            // G_{t} accumulated from the future: α_{t+1} G_{t+1}, seeded with dh_fin.
            let mut g_future = match dfinal[1] {
                Some(df) => df[bh * pd * n..][..pd * n].to_vec(),
                None => vec![0.0; pd * n],
            };
            // gradient w.r.t. k̃_t and v_t from step t+1 (β_{t+1} terms) or the final states.
            let mut carry_k = dfinal[2].map_or(vec![0.0; n], |df| df[bh * n..][..n].to_vec());
            let mut carry_v = dfinal[3].map_or(vec![0.0; pd], |df| df[bh * pd..][..pd].to_vec());
            let mut dtheta = vec![0.0; l * s];
            let mut big_g = vec![0.0; pd * n];
            for t in (0..l).rev() {
                let i = x.bht(b, h, t);
                let (adt, dt, lambda) = (x.adt[i], x.dt[i], sigmoid(x.trap[i]));
                let alpha = adt.exp();
                let gamma = lambda * dt;
                let beta = (1.0 - lambda) * dt * alpha;
                let row = x.blh(b, t, h, pd);
                let v = &x.v[row..][..pd];
                let q_rot = &tr.q_rot[t * n..][..n];
                let k_rot = &tr.k_rot[t * n..][..n];
                let y = &tr.y[t * pd..][..pd];
                let mut gvec = vec![0.0; pd];
                for a in 0..pd {
                    gvec[a] = match x.z {
                        Some(z) => {
                            dz[row + a] = dout[row + a] * y[a] * silu_derivative(z[row + a]);
                            dout[row + a] * silu(z[row + a])
                        }
                        None => dout[row + a],
                    };
                    dd[h] += gvec[a] * v[a];
                }
                for a in 0..pd {
                    for j in 0..n {
                        big_g[a * n + j] = g_future[a * n + j] + gvec[a] * q_rot[j];
                    }
                }
                let h_t = &tr.h[t * pd * n..][..pd * n];
                let mut dq_rot = vec![0.0; n];
                for j in 0..n {
                    dq_rot[j] = (0..pd).map(|a| h_t[a * n + j] * gvec[a]).sum();
                }
                let mut dk_rot = carry_k.clone();
                for j in 0..n {
                    dk_rot[j] += gamma * (0..pd).map(|a| big_g[a * n + j] * v[a]).sum::<f64>();
                }
                let gk: Vec<f64> = (0..pd).map(|a| (0..n).map(|j| big_g[a * n + j] * k_rot[j]).sum()).collect();
                for a in 0..pd {
                    dv[row + a] = d * gvec[a] + gamma * gk[a] + carry_v[a];
                }
                let dgamma: f64 = (0..pd).map(|a| v[a] * gk[a]).sum();
                let (k_prev, v_prev): (&[f64], &[f64]) = if t > 0 {
                    (&tr.k_rot[(t - 1) * n..][..n], &x.v[x.blh(b, t - 1, h, pd)..][..pd])
                } else {
                    (&k_init, &v_init)
                };
                let gk_prev: Vec<f64> = (0..pd).map(|a| (0..n).map(|j| big_g[a * n + j] * k_prev[j]).sum()).collect();
                let dbeta: f64 = (0..pd).map(|a| v_prev[a] * gk_prev[a]).sum();
                let h_prev: &[f64] = if t > 0 { &tr.h[(t - 1) * pd * n..][..pd * n] } else { &h_init };
                let dot_prev: f64 = (0..pd * n).map(|e| big_g[e] * h_prev[e]).sum();
                dadt[i] = alpha * dot_prev + beta * dbeta;
                ddt[i] = lambda * dgamma + (1.0 - lambda) * alpha * dbeta;
                dtrap[i] = dt * (dgamma - alpha * dbeta) * lambda * (1.0 - lambda);
                // terms for step t−1: β_t G_tᵀ v_{t−1}, β_t G_t k̃_{t−1}
                carry_k = (0..n).map(|j| beta * (0..pd).map(|a| big_g[a * n + j] * v_prev[a]).sum::<f64>()).collect();
                carry_v = gk_prev.iter().map(|v| beta * v).collect();
                // rotation: gradients w.r.t. un-rotated q, k and θ_t
                let theta = &tr.theta[t * s..][..s];
                let mut dq_raw = dq_rot.clone();
                let mut dk_raw = dk_rot.clone();
                for (pair, &th) in theta.iter().enumerate() {
                    let (sn, cs) = wrap_angle(th).sin_cos();
                    let mut angle = 0.0;
                    for (raw, grad, out) in [
                        (&tr.q_raw[t * n..][..n], &dq_rot, &mut dq_raw),
                        (&tr.k_raw[t * n..][..n], &dk_rot, &mut dk_raw),
                    ] {
                        let (u0, u1) = (raw[2 * pair], raw[2 * pair + 1]);
                        let (g0, g1) = (grad[2 * pair], grad[2 * pair + 1]);
                        out[2 * pair] = cs * g0 + sn * g1;
                        out[2 * pair + 1] = -sn * g0 + cs * g1;
                        angle += g0 * (-sn * u0 - cs * u1) + g1 * (cs * u0 - sn * u1);
                    }
                    dtheta[t * s + pair] = angle;
                }
                let qrow = x.blg(b, t, g);
                for j in 0..n {
                    dq[qrow + j] += dq_raw[j];
                    dk[qrow + j] += dk_raw[j];
                    dq_bias[h * n + j] += dq_raw[j];
                    dk_bias[h * n + j] += dk_raw[j];
                }
                for e in 0..pd * n {
                    g_future[e] = alpha * big_g[e];
                }
            }
            // angles: dφ_t = dΘ_fin + Σ_{u ≥ t} dθ_u
            let mut suffix = dfinal[0].map_or(vec![0.0; s], |df| df[bh * s..][..s].to_vec());
            for t in (0..l).rev() {
                let i = x.bht(b, h, t);
                let dt = x.dt[i];
                let arow = x.blh(b, t, h, s);
                for pair in 0..s {
                    suffix[pair] += dtheta[t * s + pair];
                    let th = x.angles[arow + pair].tanh();
                    dangles[arow + pair] = suffix[pair] * PI * dt * (1.0 - th * th);
                    ddt[i] += suffix[pair] * PI * th;
                }
            }
            if p.has_states {
                dangle_state[bh * s..][..s].copy_from_slice(&suffix);
                dssm_state[bh * pd * n..][..pd * n].copy_from_slice(&g_future);
                dk_state[bh * n..][..n].copy_from_slice(&carry_k);
                dv_state[bh * pd..][..pd].copy_from_slice(&carry_v);
            }
        }
    }
    let (bsz, g) = (p.batch, p.groups);
    let mut result = TensorMap::new();
    result.insert("dq".into(), tensor(vec![bsz, l, g, n], dq));
    result.insert("dk".into(), tensor(vec![bsz, l, g, n], dk));
    result.insert("dv".into(), tensor(vec![bsz, l, p.heads, pd], dv));
    result.insert("dadt".into(), tensor(vec![bsz, p.heads, l], dadt));
    result.insert("ddt".into(), tensor(vec![bsz, p.heads, l], ddt));
    result.insert("dtrap".into(), tensor(vec![bsz, p.heads, l], dtrap));
    result.insert("dq_bias".into(), tensor(vec![p.heads, n], dq_bias));
    result.insert("dk_bias".into(), tensor(vec![p.heads, n], dk_bias));
    result.insert("dangles".into(), tensor(vec![bsz, l, p.heads, s], dangles));
    if p.has_d {
        result.insert("dd".into(), tensor(vec![p.heads], dd));
    }
    if p.has_z {
        result.insert("dz".into(), tensor(vec![bsz, l, p.heads, pd], dz));
    }
    if p.has_states {
        result.insert("dangle_state".into(), tensor(vec![bsz, p.heads, s], dangle_state));
        result.insert("dssm_state".into(), tensor(vec![bsz, p.heads, pd, n], dssm_state));
        result.insert("dk_state".into(), tensor(vec![bsz, p.heads, n], dk_state));
        result.insert("dv_state".into(), tensor(vec![bsz, p.heads, pd], dv_state));
    }
    result
}

// ------------------------------------------------------------------------------------------------
// GPU launch glue
// ------------------------------------------------------------------------------------------------

push_constants! {
    /// Push constants of `mamba3_siso_prep.slang` (both entry points).
    pub struct SisoPrepPush {
        adt: u32,
        dt: u32,
        trap: u32,
        angles: u32,
        k: u32,
        k_bias: u32,
        v: u32,
        angle_state: u32,
        acs: u32,
        scale: u32,
        gamma: u32,
        theta_loc: u32,
        theta_start: u32,
        rotation: u32,
        final_angle_state: u32,
        final_k_state: u32,
        final_v_state: u32,
        batch: u32,
        length: u32,
        heads: u32,
        groups: u32,
        state: u32,
        head_dim: u32,
        rope: u32,
        chunk: u32,
        chunks: u32,
    }
}
const _: () = assert!(std::mem::size_of::<SisoPrepPush>() == kernels::mamba3_siso_prep::PUSH_CONSTANT_BYTES);

push_constants! {
    /// Push constants of `mamba3_siso_state.slang` (chunk states and state passing).
    pub struct SisoStatePush {
        q: u32,
        k: u32,
        v: u32,
        z: u32,
        dout: u32,
        q_bias: u32,
        k_bias: u32,
        acs: u32,
        scale: u32,
        rotation: u32,
        states: u32,
        init_state: u32,
        k_state: u32,
        v_state: u32,
        dt: u32,
        trap: u32,
        final_state: u32,
        batch: u32,
        length: u32,
        heads: u32,
        groups: u32,
        state: u32,
        head_dim: u32,
        rope: u32,
        chunk: u32,
        chunks: u32,
        tiles_p: u32,
        tiles_n: u32,
    }
}
const _: () = assert!(std::mem::size_of::<SisoStatePush>() == kernels::mamba3_siso_state::PUSH_CONSTANT_BYTES);

push_constants! {
    /// Push constants of `mamba3_siso_chunk.slang` (per-chunk output and its backward).
    pub struct SisoChunkPush {
        q: u32,
        k: u32,
        v: u32,
        z: u32,
        dout: u32,
        d: u32,
        q_bias: u32,
        k_bias: u32,
        acs: u32,
        scale: u32,
        gamma: u32,
        rotation: u32,
        states: u32,
        dstates: u32,
        out: u32,
        dv: u32,
        dz: u32,
        dadt: u32,
        dscale: u32,
        dgamma: u32,
        dd_partial: u32,
        dfinal_v: u32,
        ungated: u32,
        batch: u32,
        length: u32,
        heads: u32,
        groups: u32,
        state: u32,
        head_dim: u32,
        rope: u32,
        chunk: u32,
        chunks: u32,
    }
}
const _: () = assert!(std::mem::size_of::<SisoChunkPush>() == kernels::mamba3_siso_chunk::PUSH_CONSTANT_BYTES);

push_constants! {
    /// Push constants of `mamba3_siso_dqk.slang`.
    pub struct SisoDqkPush {
        q: u32,
        k: u32,
        v: u32,
        z: u32,
        dout: u32,
        q_bias: u32,
        k_bias: u32,
        acs: u32,
        scale: u32,
        gamma: u32,
        rotation: u32,
        states: u32,
        dstates: u32,
        dfinal_k: u32,
        dq: u32,
        dk: u32,
        dtheta: u32,
        dtheta_sum: u32,
        qbias_partial: u32,
        kbias_partial: u32,
        batch: u32,
        length: u32,
        heads: u32,
        groups: u32,
        state: u32,
        head_dim: u32,
        rope: u32,
        chunk: u32,
        chunks: u32,
        tiles_n: u32,
    }
}
const _: () = assert!(std::mem::size_of::<SisoDqkPush>() == kernels::mamba3_siso_dqk::PUSH_CONSTANT_BYTES);

push_constants! {
    /// Push constants of `mamba3_siso_tail.slang` (angle suffix, input-state gradients, dt/trap/angles).
    pub struct SisoTailPush {
        dtheta: u32,
        dtheta_sum: u32,
        carry: u32,
        dfinal_angle: u32,
        dangle_state: u32,
        angles: u32,
        dt: u32,
        trap: u32,
        dscale: u32,
        dgamma: u32,
        dmu0: u32,
        ddt: u32,
        dtrap: u32,
        dangles: u32,
        dssm_state: u32,
        k_state: u32,
        v_state: u32,
        dk_state: u32,
        dv_state: u32,
        batch: u32,
        length: u32,
        heads: u32,
        state: u32,
        head_dim: u32,
        rope: u32,
        chunk: u32,
        chunks: u32,
    }
}
const _: () = assert!(std::mem::size_of::<SisoTailPush>() == kernels::mamba3_siso_tail::PUSH_CONSTANT_BYTES);

/// Columns of one output tile of the chunk kernels (SISO_TILE in siso_tile.slang).
const TILE: usize = 64;
/// State dims (columns) of one chunk-state tile (STATE_COLS in mamba3_siso_state.slang).
const STATE_TILE_COLS: usize = 128;
/// Threads of the element-wise state pass.
const STATE_PASS_THREADS: usize = 256;

/// Workgroups of the fused state kernels (one per (b, h, state tile)) from which
/// `StatePassing::Auto` takes them: about two per SM of a large GPU (the H200 has 132 SMs and
/// holds two of these workgroups per SM), below which the split kernels, parallel over chunks as
/// well, finish first.
const FUSED_STATES_MIN_WORKGROUPS: usize = 192;

/// (b, h, state tile) triples: the workgroups of the fused state kernels.
fn state_tiles(p: &SisoProblem) -> usize {
    p.batch * p.heads * p.head_dim.div_ceil(TILE) * p.state.div_ceil(STATE_TILE_COLS)
}

/// Whether the states go through the fused kernels (`mamba3_siso_state_scan`, `_dstate_scan`, or
/// their counterparts on matrix tiles), as the device's `StatePassing` says.
fn fused_states(p: &SisoProblem, gpu: &dyn Gpu) -> bool {
    match gpu.state_passing() {
        StatePassing::Fused => true,
        StatePassing::Split => false,
        StatePassing::Auto => state_tiles(p) >= FUSED_STATES_MIN_WORKGROUPS,
    }
}

/// Whether the fused walks take their loader-warp form (`mamba3_siso_state_scan_ws`, 2.6% faster
/// than the plain walk on an H100, docs/PERFORMANCE.md run 38): on Vulkan's SIMT path, where every
/// state tile and chunk is regular (the shader's `regular_tile`, full 64-step chunks). NVRTC would
/// need to spill to fit it, so CUDA keeps the plain walk.
fn loader_walks(p: &SisoProblem, gpu: &dyn Gpu) -> bool {
    gpu.backend() == "vulkan"
        && gpu.matrix_path() == MatrixPath::Simt
        && p.chunk == TILE
        && p.length % TILE == 0
        && p.head_dim % TILE == 0
        && p.state % STATE_TILE_COLS == 0
        && p.rope % 2 == 0
        && p.rope > 0
}

/// The dispatches that compute the states of every chunk (S_in, or dS_out with `GRAD`): the fused
/// kernel, or the chunk kernel and its pass. Forward and gradient chains have the same length, so
/// the backward runs them step by step side by side.
fn state_chain(p: &SisoProblem, gpu: &dyn Gpu, push: &SisoStatePush, grad: bool) -> Result<Vec<Dispatch>> {
    use kernels::mamba3_siso_state as state;
    let paths = path_kernels(gpu);
    if fused_states(p, gpu) {
        let kernel = match (loader_walks(p, gpu), grad) {
            (true, false) => state::MAMBA3_SISO_STATE_SCAN_WS,
            (true, true) => state::MAMBA3_SISO_DSTATE_SCAN_WS,
            (false, false) => paths.state_scan,
            (false, true) => paths.dstate_scan,
        };
        return Ok(vec![Dispatch::linear(kernel, state_tiles(p) as u64, push)?]);
    }
    let (local, pass) = if grad {
        (paths.chunk_dstate, state::MAMBA3_SISO_STATE_PASS_REVERSE)
    } else {
        (paths.chunk_state, state::MAMBA3_SISO_STATE_PASS)
    };
    Ok(vec![
        Dispatch::linear(local, (state_tiles(p) * p.chunks()) as u64, push)?,
        Dispatch::linear(pass, state_pass_groups(p), push)?,
    ])
}

/// Workgroups of the state passes: a thread per 4 elements of a P×N matrix when P·N is a multiple
/// of 4 (16-byte accesses), else per element (mamba3_siso_state.slang, state_pass_dispatch).
fn state_pass_groups(p: &SisoProblem) -> u64 {
    let matrix = p.head_dim * p.state;
    let width = if matrix % 4 == 0 { 4 } else { 1 };
    (p.batch * p.heads * matrix / width).div_ceil(STATE_PASS_THREADS) as u64
}

/// The kernels of one matrix path (`Gpu::matrix_path`): the SIMT ones, or their counterparts on
/// matrix tiles (tensor cores, or the same tiles emulated).
struct PathKernels {
    chunk_state: KernelRef,
    chunk_dstate: KernelRef,
    state_scan: KernelRef,
    dstate_scan: KernelRef,
    chunk_fwd: KernelRef,
    /// chunk_fwd that also stores y before the gate (`ungated`)
    chunk_fwd_save: KernelRef,
    dqk: KernelRef,
}

fn path_kernels(gpu: &dyn Gpu) -> PathKernels {
    use kernels::{mamba3_siso_chunk as chunk, mamba3_siso_mma_chunk as mma_chunk};
    use kernels::{mamba3_siso_mma_state as mma_state, mamba3_siso_state as state};
    match gpu.matrix_path() {
        MatrixPath::Simt => PathKernels {
            chunk_state: state::MAMBA3_SISO_CHUNK_STATE,
            chunk_dstate: state::MAMBA3_SISO_CHUNK_DSTATE,
            state_scan: state::MAMBA3_SISO_STATE_SCAN,
            dstate_scan: state::MAMBA3_SISO_DSTATE_SCAN,
            chunk_fwd: chunk::MAMBA3_SISO_CHUNK_FWD,
            chunk_fwd_save: chunk::MAMBA3_SISO_CHUNK_FWD_SAVE,
            dqk: kernels::mamba3_siso_dqk::MAMBA3_SISO_DQK,
        },
        MatrixPath::TensorCores => PathKernels {
            chunk_state: mma_state::MAMBA3_SISO_MMA_CHUNK_STATE,
            chunk_dstate: mma_state::MAMBA3_SISO_MMA_CHUNK_DSTATE,
            state_scan: mma_state::MAMBA3_SISO_MMA_STATE_SCAN,
            dstate_scan: mma_state::MAMBA3_SISO_MMA_DSTATE_SCAN,
            chunk_fwd: mma_chunk::MAMBA3_SISO_MMA_CHUNK_FWD,
            chunk_fwd_save: mma_chunk::MAMBA3_SISO_MMA_CHUNK_FWD,
            dqk: kernels::mamba3_siso_mma_dqk::MAMBA3_SISO_MMA_DQK,
        },
        MatrixPath::Emulated => PathKernels {
            chunk_state: mma_state::MAMBA3_SISO_MMA_EMULATED_CHUNK_STATE,
            chunk_dstate: mma_state::MAMBA3_SISO_MMA_EMULATED_CHUNK_DSTATE,
            state_scan: mma_state::MAMBA3_SISO_MMA_EMULATED_STATE_SCAN,
            dstate_scan: mma_state::MAMBA3_SISO_MMA_EMULATED_DSTATE_SCAN,
            chunk_fwd: mma_chunk::MAMBA3_SISO_MMA_EMULATED_CHUNK_FWD,
            chunk_fwd_save: mma_chunk::MAMBA3_SISO_MMA_EMULATED_CHUNK_FWD,
            dqk: kernels::mamba3_siso_mma_dqk::MAMBA3_SISO_MMA_EMULATED_DQK,
        },
    }
}

/// The slots every pass shares: inputs and the forward scratch.
struct Common {
    q: u32,
    k: u32,
    v: u32,
    z: u32,
    d: u32,
    q_bias: u32,
    k_bias: u32,
    trap: u32,
    dt: u32,
    angles: u32,
    states_in: Option<[u32; 4]>,
    acs: u32,
    scale: u32,
    gamma: u32,
    theta_loc: u32,
    theta_start: u32,
    rotation: u32,
    states: u32,
}

fn u(value: usize) -> u32 {
    value as u32
}

/// Allocates the forward scratch and records prep, angle pass and rotation; returns the state
/// chain (`state_chain`) for the caller to record (the backward records its gradient chain beside it).
/// `finals` = (final_angle_state, final_ssm_state, final_k_state, final_v_state) slots, or NO_BUFFER.
fn record_states(
    p: &SisoProblem,
    gpu: &dyn Gpu,
    inputs: &GpuTensors,
    recorded: &mut Recorded,
    op: &str,
    finals: [u32; 4],
    states: Option<u32>,
) -> Result<(Common, Vec<Dispatch>)> {
    let (bh, l, nc) = (p.batch * p.heads, p.length, p.chunks());
    let states_in = if p.has_states {
        Some([
            slot(inputs, op, "angle_state")?,
            slot(inputs, op, "ssm_state")?,
            slot(inputs, op, "k_state")?,
            slot(inputs, op, "v_state")?,
        ])
    } else {
        None
    };
    let common = Common {
        q: slot(inputs, op, "q")?,
        k: slot(inputs, op, "k")?,
        v: slot(inputs, op, "v")?,
        z: optional_slot(inputs, "z"),
        d: optional_slot(inputs, "d"),
        q_bias: slot(inputs, op, "q_bias")?,
        k_bias: slot(inputs, op, "k_bias")?,
        trap: slot(inputs, op, "trap")?,
        dt: slot(inputs, op, "dt")?,
        angles: slot(inputs, op, "angles")?,
        states_in,
        acs: recorded.scratch(gpu, op, "cumulative decay (scratch)", bh * l)?,
        scale: recorded.scratch(gpu, op, "input scale (scratch)", bh * l)?,
        gamma: recorded.scratch(gpu, op, "gamma (scratch)", bh * l)?,
        theta_loc: recorded.scratch(gpu, op, "in-chunk angles (scratch)", bh * l * p.rope)?,
        theta_start: recorded.scratch(gpu, op, "chunk angle prefixes (scratch)", bh * (nc + 1) * p.rope)?,
        rotation: recorded.scratch(gpu, op, "rotation table (scratch)", 2 * bh * l * p.rope)?,
        states: match states {
            Some(slot) => slot,
            None => recorded.scratch(gpu, op, "chunk states (scratch)", bh * nc * p.head_dim * p.state)?,
        },
    };
    let prep = SisoPrepPush {
        adt: slot(inputs, op, "adt")?,
        dt: common.dt,
        trap: common.trap,
        angles: common.angles,
        k: common.k,
        k_bias: common.k_bias,
        v: common.v,
        angle_state: states_in.map_or(NO_BUFFER, |s| s[0]),
        acs: common.acs,
        scale: common.scale,
        gamma: common.gamma,
        theta_loc: common.theta_loc,
        theta_start: common.theta_start,
        rotation: common.rotation,
        final_angle_state: finals[0],
        final_k_state: finals[2],
        final_v_state: finals[3],
        batch: u(p.batch),
        length: u(l),
        heads: u(p.heads),
        groups: u(p.groups),
        state: u(p.state),
        head_dim: u(p.head_dim),
        rope: u(p.rope),
        chunk: u(p.chunk),
        chunks: u(nc),
    };
    recorded.dispatches.push(Dispatch::linear(kernels::mamba3_siso_prep::MAMBA3_SISO_PREP, (bh * nc) as u64, &prep)?);
    recorded.dispatches.push(Dispatch::linear(kernels::mamba3_siso_prep::MAMBA3_SISO_ANGLE_PASS, bh as u64, &prep)?);
    if p.rope > 0 {
        // two pairs per thread when S is even (mamba3_siso_rotation)
        let threads = bh * l * p.rope / if p.rope % 2 == 0 { 2 } else { 1 };
        recorded.dispatches.push(Dispatch::linear(
            kernels::mamba3_siso_prep::MAMBA3_SISO_ROTATION,
            threads.div_ceil(256) as u64,
            &prep,
        )?);
    }
    let state = state_push(p, &common, NO_BUFFER, common.states, finals[1]);
    let state = SisoStatePush {
        init_state: states_in.map_or(NO_BUFFER, |s| s[1]),
        k_state: states_in.map_or(NO_BUFFER, |s| s[2]),
        v_state: states_in.map_or(NO_BUFFER, |s| s[3]),
        ..state
    };
    let chain = state_chain(p, gpu, &state, false)?;
    Ok((common, chain))
}

fn state_push(p: &SisoProblem, c: &Common, dout: u32, states: u32, final_state: u32) -> SisoStatePush {
    SisoStatePush {
        q: c.q,
        k: c.k,
        v: c.v,
        z: c.z,
        dout,
        q_bias: c.q_bias,
        k_bias: c.k_bias,
        acs: c.acs,
        scale: c.scale,
        rotation: c.rotation,
        states,
        init_state: NO_BUFFER,
        k_state: NO_BUFFER,
        v_state: NO_BUFFER,
        dt: c.dt,
        trap: c.trap,
        final_state,
        batch: u(p.batch),
        length: u(p.length),
        heads: u(p.heads),
        groups: u(p.groups),
        state: u(p.state),
        head_dim: u(p.head_dim),
        rope: u(p.rope),
        chunk: u(p.chunk),
        chunks: u(p.chunks()),
        tiles_p: u(p.head_dim.div_ceil(TILE)),
        tiles_n: u(p.state.div_ceil(STATE_TILE_COLS)),
    }
}

fn chunk_push(p: &SisoProblem, c: &Common) -> SisoChunkPush {
    SisoChunkPush {
        q: c.q,
        k: c.k,
        v: c.v,
        z: c.z,
        dout: NO_BUFFER,
        d: c.d,
        q_bias: c.q_bias,
        k_bias: c.k_bias,
        acs: c.acs,
        scale: c.scale,
        gamma: c.gamma,
        rotation: c.rotation,
        states: c.states,
        dstates: NO_BUFFER,
        out: NO_BUFFER,
        dv: NO_BUFFER,
        dz: NO_BUFFER,
        dadt: NO_BUFFER,
        dscale: NO_BUFFER,
        dgamma: NO_BUFFER,
        dd_partial: NO_BUFFER,
        dfinal_v: NO_BUFFER,
        ungated: NO_BUFFER,
        batch: u(p.batch),
        length: u(p.length),
        heads: u(p.heads),
        groups: u(p.groups),
        state: u(p.state),
        head_dim: u(p.head_dim),
        rope: u(p.rope),
        chunk: u(p.chunk),
        chunks: u(p.chunks()),
    }
}

/// Bytes of the tensors every pass reads at least once.
fn input_bytes(p: &SisoProblem) -> u64 {
    let (b, l, h, g, n, pd, s) = (p.batch, p.length, p.heads, p.groups, p.state, p.head_dim, p.rope);
    let mut elements = 2 * b * l * g * n + b * l * h * pd + 3 * b * h * l + 2 * h * n + b * l * h * s;
    if p.has_d {
        elements += h;
    }
    if p.has_z {
        elements += b * l * h * pd;
    }
    if p.has_states {
        elements += b * h * (s + pd * n + n + pd);
    }
    4 * elements as u64
}

/// `mamba3_siso_fwd`.
pub struct SisoFwd;

impl OpDef for SisoFwd {
    const NAME: &'static str = "mamba3_siso_fwd";
    type Problem = SisoProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<SisoProblem> {
        let mut p = check_common(shapes, scalars)?;
        p.save_for_backward = scalars.flag_or("save_for_backward", false)?;
        Ok(p)
    }

    fn reference(p: &SisoProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        reference_forward(p, inputs)
    }

    fn record(p: &SisoProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        let op = Self::NAME;
        let mut recorded = Recorded::default();
        let (b, h) = (p.batch, p.heads);
        let out = recorded.output(gpu, op, "out", vec![b, p.length, h, p.head_dim])?;
        let finals = [
            recorded.output(gpu, op, "final_angle_state", vec![b, h, p.rope])?,
            recorded.output(gpu, op, "final_ssm_state", vec![b, h, p.head_dim, p.state])?,
            recorded.output(gpu, op, "final_k_state", vec![b, h, p.state])?,
            recorded.output(gpu, op, "final_v_state", vec![b, h, p.head_dim])?,
        ];
        // saved for the backward: the walk's chunk states go to an output instead of scratch
        let states = if p.save_for_backward {
            Some(recorded.output(gpu, op, CHUNK_STATES, chunk_states_shape(p))?)
        } else {
            None
        };
        let (common, state_chain) = record_states(p, gpu, inputs, &mut recorded, op, finals, states)?;
        recorded.dispatches.extend(state_chain);
        let (kernel, ungated) = if p.save_for_backward && p.has_z {
            let shape = vec![b, p.length, h, p.head_dim];
            (path_kernels(gpu).chunk_fwd_save, recorded.output(gpu, op, UNGATED_OUT, shape)?)
        } else {
            (path_kernels(gpu).chunk_fwd, NO_BUFFER)
        };
        let push = SisoChunkPush { out, ungated, ..chunk_push(p, &common) };
        recorded.dispatches.push(Dispatch::linear(kernel, (b * h * p.chunks()) as u64, &push)?);
        Ok(recorded)
    }

    fn traffic_bytes(p: &SisoProblem) -> u64 {
        let (b, h, n, pd) = (p.batch, p.heads, p.state, p.head_dim);
        let mut saved = if p.save_for_backward { b * h * p.chunks() * pd * n } else { 0 };
        if p.save_for_backward && p.has_z {
            saved += b * p.length * h * pd;
        }
        input_bytes(p) + 4 * (b * p.length * h * pd + b * h * (p.rope + pd * n + n + pd) + saved) as u64
    }

    /// Per step of every (b, h): the chunk's state contribution (2PN), the inter-chunk output (2PN),
    /// and the causal halves of the intra-chunk scores (Q·N) and their product with v (Q·P).
    fn flops(p: &SisoProblem) -> u64 {
        let per_step = 4 * p.head_dim * p.state + p.chunk * (p.state + p.head_dim);
        (p.batch * p.heads * p.length * per_step) as u64
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        example_inputs(&SisoShape::for_size(size), false, seed)
    }

    fn coverage_examples(seed: u64) -> Vec<(TensorMap, Scalars)> {
        coverage_examples(false, seed)
    }
}

/// `mamba3_siso_bwd`.
pub struct SisoBwd;

const DFINAL: [&str; 4] = ["dfinal_angle_state", "dfinal_ssm_state", "dfinal_k_state", "dfinal_v_state"];

impl OpDef for SisoBwd {
    const NAME: &'static str = "mamba3_siso_bwd";
    type Problem = SisoProblem;

    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<SisoProblem> {
        let mut p = check_common(shapes, scalars)?;
        let (b, l, h, n, pd, s) = (p.batch, p.length, p.heads, p.state, p.head_dim, p.rope);
        shapes.exact("dout", &[("B", b), ("L", l), ("H", h), ("P", pd)])?;
        p.has_dfinal = [
            shapes.exact_optional(DFINAL[0], &[("B", b), ("H", h), ("S", s)])?,
            shapes.exact_optional(DFINAL[1], &[("B", b), ("H", h), ("P", pd), ("N", n)])?,
            shapes.exact_optional(DFINAL[2], &[("B", b), ("H", h), ("N", n)])?,
            shapes.exact_optional(DFINAL[3], &[("B", b), ("H", h), ("P", pd)])?,
        ];
        p.has_chunk_states = shapes.exact_optional(CHUNK_STATES, &chunk_states_dims(&p))?;
        p.has_ungated_out = shapes.exact_optional(UNGATED_OUT, &[("B", b), ("L", l), ("H", h), ("P", pd)])?;
        Ok(p)
    }

    fn reference(p: &SisoProblem, inputs: &TensorMap<f64>) -> TensorMap<f64> {
        reference_backward(p, inputs)
    }

    fn record(p: &SisoProblem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded> {
        let op = Self::NAME;
        let mut recorded = Recorded::default();
        let (b, l, h, g, n, pd, s, nc) =
            (p.batch, p.length, p.heads, p.groups, p.state, p.head_dim, p.rope, p.chunks());
        let bh = b * h;
        let dout = slot(inputs, op, "dout")?;
        let dfinal = DFINAL.map(|name| optional_slot(inputs, name));

        let dq = recorded.output(gpu, op, "dq", vec![b, l, g, n])?;
        let dk = recorded.output(gpu, op, "dk", vec![b, l, g, n])?;
        let dv = recorded.output(gpu, op, "dv", vec![b, l, h, pd])?;
        let dadt = recorded.output(gpu, op, "dadt", vec![b, h, l])?;
        let ddt = recorded.output(gpu, op, "ddt", vec![b, h, l])?;
        let dtrap = recorded.output(gpu, op, "dtrap", vec![b, h, l])?;
        let dq_bias = recorded.output(gpu, op, "dq_bias", vec![h, n])?;
        let dk_bias = recorded.output(gpu, op, "dk_bias", vec![h, n])?;
        let dangles = recorded.output(gpu, op, "dangles", vec![b, l, h, s])?;
        let dd = if p.has_d { recorded.output(gpu, op, "dd", vec![h])? } else { NO_BUFFER };
        let dz = if p.has_z { recorded.output(gpu, op, "dz", vec![b, l, h, pd])? } else { NO_BUFFER };
        let dstates_in = if p.has_states {
            [
                recorded.output(gpu, op, "dangle_state", vec![b, h, s])?,
                recorded.output(gpu, op, "dssm_state", vec![b, h, pd, n])?,
                recorded.output(gpu, op, "dk_state", vec![b, h, n])?,
                recorded.output(gpu, op, "dv_state", vec![b, h, pd])?,
            ]
        } else {
            [NO_BUFFER; 4]
        };

        // S_in of every chunk: the forward's, when it saved them, else recomputed
        let saved = if p.has_chunk_states { Some(slot(inputs, op, CHUNK_STATES)?) } else { None };
        let (common, mut forward_chain) = record_states(p, gpu, inputs, &mut recorded, op, [NO_BUFFER; 4], saved)?;
        if saved.is_some() {
            forward_chain.clear(); // the forward's walk is not repeated
        }

        // gradient of the state leaving every chunk
        let dstates = recorded.scratch(gpu, op, "chunk state gradients (scratch)", bh * nc * pd * n)?;
        let dstate = SisoStatePush { init_state: dfinal[1], ..state_push(p, &common, dout, dstates, dstates_in[1]) };
        let gradient_chain = state_chain(p, gpu, &dstate, true)?;
        // The gradient chain is independent of the forward one: each step runs alongside its
        // counterpart, so the latency-bound passes share the GPU instead of following each other.
        if forward_chain.is_empty() {
            recorded.dispatches.extend(gradient_chain);
        } else {
            for (forward, gradient) in forward_chain.into_iter().zip(gradient_chain) {
                recorded.dispatches.push(forward);
                recorded.dispatches.push(gradient.alongside_previous());
            }
        }

        // per chunk: dv, dz, dadt, dscale, dγ, dd partials
        let dscale = recorded.scratch(gpu, op, "dscale (scratch)", bh * l)?;
        let dgamma = recorded.scratch(gpu, op, "dgamma (scratch)", bh * l)?;
        let dd_partial = if p.has_d { recorded.scratch(gpu, op, "dd partials", b * nc * h)? } else { NO_BUFFER };
        let chunk = SisoChunkPush {
            dout,
            dstates,
            dv,
            dz,
            dadt,
            dscale,
            dgamma,
            dd_partial,
            dfinal_v: dfinal[3],
            ungated: if p.has_ungated_out { slot(inputs, op, UNGATED_OUT)? } else { NO_BUFFER },
            ..chunk_push(p, &common)
        };
        let chunk_kernel = if p.has_ungated_out {
            kernels::mamba3_siso_chunk::MAMBA3_SISO_CHUNK_BWD_SAVED
        } else {
            kernels::mamba3_siso_chunk::MAMBA3_SISO_CHUNK_BWD
        };
        let chunk_bwd = Dispatch::linear(chunk_kernel, (bh * nc) as u64, &chunk)?;

        // per chunk and group: dq, dk, dθ, bias partials
        let dtheta = recorded.scratch(gpu, op, "angle gradients (scratch)", bh * l * s)?;
        let dtheta_sum = recorded.scratch(gpu, op, "chunk angle gradient sums (scratch)", bh * nc * s)?;
        let qbias_partial = recorded.scratch(gpu, op, "dq_bias partials", b * nc * h * n)?;
        let kbias_partial = recorded.scratch(gpu, op, "dk_bias partials", b * nc * h * n)?;
        let tiles_n = n.div_ceil(TILE);
        let dqk = SisoDqkPush {
            q: common.q,
            k: common.k,
            v: common.v,
            z: common.z,
            dout,
            q_bias: common.q_bias,
            k_bias: common.k_bias,
            acs: common.acs,
            scale: common.scale,
            gamma: common.gamma,
            rotation: common.rotation,
            states: common.states,
            dstates,
            dfinal_k: dfinal[2],
            dq,
            dk,
            dtheta,
            dtheta_sum,
            qbias_partial,
            kbias_partial,
            batch: u(b),
            length: u(l),
            heads: u(h),
            groups: u(g),
            state: u(n),
            head_dim: u(pd),
            rope: u(s),
            chunk: u(p.chunk),
            chunks: u(nc),
            tiles_n: u(tiles_n),
        };
        // dqk and chunk_bwd read none of each other's outputs: they run side by side, dqk first. Its
        // few long workgroups (one per chunk, tile and group, looping over the heads) are then all
        // placed before chunk_bwd's many short ones, which fill the multiprocessors that dqk's last
        // wave leaves idle (docs/PERFORMANCE.md, run 22).
        recorded.dispatches.push(Dispatch::linear(path_kernels(gpu).dqk, (b * g * nc * tiles_n) as u64, &dqk)?);
        recorded.dispatches.push(chunk_bwd.alongside_previous());

        // angles, input states, dt and trap
        let carry = recorded.scratch(gpu, op, "angle gradient carries (scratch)", bh * nc * s)?;
        let dmu0 = if p.has_states { recorded.scratch(gpu, op, "dmu0 (scratch)", bh)? } else { NO_BUFFER };
        let states_in = common.states_in;
        let tail = SisoTailPush {
            dtheta,
            dtheta_sum,
            carry,
            dfinal_angle: dfinal[0],
            dangle_state: dstates_in[0],
            angles: common.angles,
            dt: common.dt,
            trap: common.trap,
            dscale,
            dgamma,
            dmu0,
            ddt,
            dtrap,
            dangles,
            dssm_state: dstates_in[1],
            k_state: states_in.map_or(NO_BUFFER, |st| st[2]),
            v_state: states_in.map_or(NO_BUFFER, |st| st[3]),
            dk_state: dstates_in[2],
            dv_state: dstates_in[3],
            batch: u(b),
            length: u(l),
            heads: u(h),
            state: u(n),
            head_dim: u(pd),
            rope: u(s),
            chunk: u(p.chunk),
            chunks: u(nc),
        };
        recorded.dispatches.push(Dispatch::linear(
            kernels::mamba3_siso_tail::MAMBA3_SISO_ANGLE_SUFFIX,
            bh as u64,
            &tail,
        )?);
        if p.has_states {
            recorded.dispatches.push(Dispatch::linear(
                kernels::mamba3_siso_tail::MAMBA3_SISO_STATE_GRADS,
                bh as u64,
                &tail,
            )?);
        }
        recorded.dispatches.push(Dispatch::linear(
            kernels::mamba3_siso_tail::MAMBA3_SISO_TAIL,
            (bh * nc) as u64,
            &tail,
        )?);

        // sums over batch and time, in a fixed order
        let rows = b * nc;
        for (partial, output) in [(qbias_partial, dq_bias), (kbias_partial, dk_bias)] {
            let partials = Partials { slot: partial, rows, cols: h * n, offset: 0, row_stride: h * n };
            column_sums(&mut recorded, gpu, op, partials, output)?;
        }
        if p.has_d {
            let partials = Partials { slot: dd_partial, rows, cols: h, offset: 0, row_stride: h };
            column_sums(&mut recorded, gpu, op, partials, dd)?;
        }
        Ok(recorded)
    }

    fn traffic_bytes(p: &SisoProblem) -> u64 {
        let (b, l, h, g, n, pd, s) = (p.batch, p.length, p.heads, p.groups, p.state, p.head_dim, p.rope);
        let mut grads = 2 * b * l * g * n + b * l * h * pd + 3 * b * h * l + 2 * h * n + b * l * h * s;
        let mut reads = b * l * h * pd; // dout
        if p.has_d {
            grads += h;
        }
        if p.has_z {
            grads += b * l * h * pd;
        }
        if p.has_states {
            grads += b * h * (s + pd * n + n + pd);
        }
        if p.has_chunk_states {
            reads += b * h * p.chunks() * pd * n;
        }
        if p.has_ungated_out {
            reads += b * l * h * pd;
        }
        reads += p
            .has_dfinal
            .iter()
            .zip([s, pd * n, n, pd])
            .filter(|(given, _)| **given)
            .map(|(_, e)| b * h * e)
            .sum::<usize>();
        input_bytes(p) + 4 * (grads + reads) as u64
    }

    /// Per step of every (b, h): recomputed chunk state, dS_loc, the inter-chunk output, the state
    /// term of dv/dscale, the inter-chunk dq and the state term of dk (2PN each), and the causal
    /// halves of the six chunk-local products (scores, y, W, g·vᵀ: Q·N or Q·P each; dq, dk: Q·N).
    /// Given the forward's `chunk_states`, the chunk state is not recomputed; given `ungated_out`,
    /// neither is y (its inter-chunk and intra-chunk products).
    fn flops(p: &SisoProblem) -> u64 {
        let state_products = 12 - 2 * usize::from(p.has_chunk_states) - 2 * usize::from(p.has_ungated_out);
        let step_products = 3 - usize::from(p.has_ungated_out);
        let per_step = state_products * p.head_dim * p.state + p.chunk * (3 * p.state + step_products * p.head_dim);
        (p.batch * p.heads * p.length * per_step) as u64
    }

    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        example_inputs(&SisoShape::for_size(size), true, seed)
    }

    fn coverage_examples(seed: u64) -> Vec<(TensorMap, Scalars)> {
        coverage_examples(true, seed)
    }
}

// ------------------------------------------------------------------------------------------------
// Example inputs
// ------------------------------------------------------------------------------------------------

/// The sizes and options of one test or benchmark case.
#[derive(Clone, Debug, PartialEq)]
pub struct SisoShape {
    pub batch: usize,
    pub length: usize,
    pub heads: usize,
    pub groups: usize,
    pub state: usize,
    pub head_dim: usize,
    pub rope: usize,
    pub chunk: usize,
    pub d: bool,
    pub z: bool,
    pub states: bool,
    /// Backward: give all four final-state gradients.
    pub final_grads: bool,
}

impl SisoShape {
    /// The benchmark shape of the issue: B=8, L=4096, H=32, G=1, N=128, P=64, S=32, z and d, chunk 64.
    pub fn bench() -> Self {
        SisoShape {
            batch: 8,
            length: 4096,
            heads: 32,
            groups: 1,
            state: 128,
            head_dim: 64,
            rope: 32,
            chunk: 64,
            d: true,
            z: true,
            states: false,
            final_grads: false,
        }
    }

    /// The smallest shape whose tiles and chunks are all regular (full 64-step chunks, P a multiple
    /// of 64, N of 128, S even): the walks' loader-warp form on Vulkan.
    /// Its optional inputs are the small example's (all given).
    pub fn regular() -> Self {
        SisoShape {
            batch: 1,
            length: 128,
            heads: 1,
            groups: 1,
            state: 128,
            head_dim: 64,
            rope: 32,
            chunk: 64,
            ..Self::for_size(ExampleSize::Small)
        }
    }

    pub fn for_size(size: ExampleSize) -> Self {
        match size {
            ExampleSize::Gpu => Self::bench(),
            // the bench shape at 1/64 of the work: B=1, L=2048, H=8 (lavapipe: a few seconds)
            ExampleSize::CpuDevice => SisoShape { batch: 1, length: 2048, heads: 8, ..Self::bench() },
            ExampleSize::Small => SisoShape {
                batch: 2,
                length: 37,
                heads: 4,
                groups: 2,
                state: 16,
                head_dim: 8,
                rope: 4,
                chunk: 16,
                d: true,
                z: true,
                states: true,
                final_grads: true,
            },
        }
    }
}

/// The registry test's examples of both SISO ops: the small one, and a regular one (full 64-step
/// chunks, N = 128, P = 64) whose fused walks take their loader-warp form on Vulkan; and the
/// small one saving for the backward (forward) or given what the forward saves (backward: the
/// reference forward's, which the reference backward matches as well as its own recomputation).
fn coverage_examples(backward: bool, seed: u64) -> Vec<(TensorMap, Scalars)> {
    let small = SisoShape::for_size(ExampleSize::Small);
    let mut examples: Vec<_> =
        [small.clone(), SisoShape::regular()].iter().map(|shape| example_inputs(shape, backward, seed)).collect();
    let (inputs, scalars) = example_inputs(&small, backward, seed);
    if !backward {
        examples.push((inputs, scalars.with("save_for_backward", 1)));
        return examples;
    }
    // the reference forward's saved tensors (a failure leaves them out, and the registry test,
    // which needs this example to reach the saved-y kernel, says so)
    let saved = with_saved_forward(&Device::cpu(), &inputs, &scalars).unwrap_or(inputs);
    examples.push((saved, scalars));
    examples
}

/// Random inputs with the distributions of the issue: dt log-uniform in [1e-3, 1e-1],
/// adt = −U[1e-4, 16]·dt, q and k unit-scale (like RMS-normalised vectors), biases near 1,
/// angles and trap standard normal.
pub fn example_inputs(s: &SisoShape, backward: bool, seed: u64) -> (TensorMap, Scalars) {
    let mut rng = Rng::new(seed);
    let (b, l, h, g, n, p, r) = (s.batch, s.length, s.heads, s.groups, s.state, s.head_dim, s.rope);
    let mut inputs = TensorMap::new();
    inputs.insert("q".into(), rng.normal_tensor(vec![b, l, g, n], 1.0));
    inputs.insert("k".into(), rng.normal_tensor(vec![b, l, g, n], 1.0));
    inputs.insert("v".into(), rng.normal_tensor(vec![b, l, h, p], 1.0));
    let dt = Tensor::from_fn(vec![b, h, l], |_| rng.log_uniform(1e-3, 1e-1) as f32);
    let adt = Tensor::from_fn(vec![b, h, l], |i| (-rng.uniform(1e-4, 16.0) * f64::from(dt.data()[i])) as f32);
    inputs.insert("adt".into(), adt);
    inputs.insert("dt".into(), dt);
    inputs.insert("trap".into(), rng.normal_tensor(vec![b, h, l], 1.0));
    inputs.insert("q_bias".into(), rng.uniform_tensor(vec![h, n], 0.5, 1.5));
    inputs.insert("k_bias".into(), rng.uniform_tensor(vec![h, n], 0.5, 1.5));
    inputs.insert("angles".into(), rng.normal_tensor(vec![b, l, h, r], 1.0));
    if s.d {
        inputs.insert("d".into(), rng.uniform_tensor(vec![h], 0.5, 1.5));
    }
    if s.z {
        inputs.insert("z".into(), rng.normal_tensor(vec![b, l, h, p], 1.0));
    }
    if s.states {
        inputs.insert("angle_state".into(), rng.uniform_tensor(vec![b, h, r], 0.0, TAU));
        inputs.insert("ssm_state".into(), rng.normal_tensor(vec![b, h, p, n], 0.5));
        inputs.insert("k_state".into(), Tensor::from_fn(vec![b, h, n], |_| (1.0 + rng.normal()) as f32));
        inputs.insert("v_state".into(), rng.normal_tensor(vec![b, h, p], 1.0));
    }
    if backward {
        inputs.insert("dout".into(), rng.normal_tensor(vec![b, l, h, p], 1.0));
        if s.final_grads {
            inputs.insert("dfinal_angle_state".into(), rng.normal_tensor(vec![b, h, r], 1.0));
            inputs.insert("dfinal_ssm_state".into(), rng.normal_tensor(vec![b, h, p, n], 1.0));
            inputs.insert("dfinal_k_state".into(), rng.normal_tensor(vec![b, h, n], 1.0));
            inputs.insert("dfinal_v_state".into(), rng.normal_tensor(vec![b, h, p], 1.0));
        }
    }
    let scalars = Scalars::new().with("chunk_size", s.chunk);
    (inputs, scalars)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{finite_difference_error, weighted_sum};

    fn problem(s: &SisoShape) -> SisoProblem {
        SisoProblem {
            batch: s.batch,
            length: s.length,
            heads: s.heads,
            groups: s.groups,
            state: s.state,
            head_dim: s.head_dim,
            rope: s.rope,
            chunk: s.chunk,
            has_d: s.d,
            has_z: s.z,
            has_states: s.states,
            has_dfinal: [s.final_grads; 4],
            save_for_backward: false,
            has_chunk_states: false,
            has_ungated_out: false,
        }
    }

    #[test]
    fn push_layouts_match_reflection() {
        use crate::gpu::check_push_layout;
        check_push_layout::<SisoPrepPush>(kernels::mamba3_siso_prep::FILE).unwrap();
        check_push_layout::<SisoStatePush>(kernels::mamba3_siso_state::FILE).unwrap();
        check_push_layout::<SisoStatePush>(kernels::mamba3_siso_mma_state::FILE).unwrap();
        check_push_layout::<SisoChunkPush>(kernels::mamba3_siso_chunk::FILE).unwrap();
        check_push_layout::<SisoChunkPush>(kernels::mamba3_siso_mma_chunk::FILE).unwrap();
        check_push_layout::<SisoDqkPush>(kernels::mamba3_siso_dqk::FILE).unwrap();
        check_push_layout::<SisoDqkPush>(kernels::mamba3_siso_mma_dqk::FILE).unwrap();
        check_push_layout::<SisoTailPush>(kernels::mamba3_siso_tail::FILE).unwrap();
    }

    /// Central finite differences of a random linear loss of every output (out and the four final
    /// states, weighted by dout and the four final-state gradients) against the backward reference,
    /// at every input, with and without the optional inputs.
    #[test]
    fn reference_backward_matches_finite_differences() {
        let base = SisoShape {
            batch: 2,
            length: 5,
            heads: 4,
            groups: 2,
            state: 6,
            head_dim: 3,
            rope: 2,
            chunk: 2,
            d: true,
            z: true,
            states: true,
            final_grads: true,
        };
        let cases = [
            base.clone(),
            SisoShape { d: false, z: false, states: false, final_grads: false, groups: 1, ..base.clone() },
            SisoShape { z: false, states: true, final_grads: false, heads: 2, groups: 2, rope: 3, ..base.clone() },
            SisoShape { d: false, states: false, final_grads: true, length: 1, rope: 1, ..base.clone() },
        ];
        for shape in cases {
            let p = problem(&shape);
            let (inputs, _) = example_inputs(&shape, true, 5);
            let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
            let mut weights = TensorMap::new();
            weights.insert("out".to_string(), wide["dout"].clone());
            if shape.final_grads {
                for (out, grad) in FINAL_STATES.iter().zip([
                    "dfinal_angle_state",
                    "dfinal_ssm_state",
                    "dfinal_k_state",
                    "dfinal_v_state",
                ]) {
                    weights.insert(out.to_string(), wide[grad].clone());
                }
            }
            let loss = |i: &TensorMap<f64>| weighted_sum(&reference_forward(&p, i), &weights);
            let grads = reference_backward(&p, &wide);
            let mut names = vec!["q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles"];
            if shape.d {
                names.push("d");
            }
            if shape.z {
                names.push("z");
            }
            if shape.states {
                names.extend(INPUT_STATES);
            }
            let (error, at) = finite_difference_error(&loss, &wide, &grads, &names, 200, 1e-6);
            assert!(error < 1e-6, "{shape:?}: {error:e} at {at}");
        }
    }

    /// The final angle state is θ mod 2π in [0, 2π), with θ accumulated without wrapping.
    #[test]
    fn final_angle_is_wrapped() {
        let shape = SisoShape { length: 300, ..SisoShape::for_size(ExampleSize::Small) };
        let p = problem(&shape);
        let (inputs, _) = example_inputs(&shape, false, 3);
        let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
        let out = reference_forward(&p, &wide);
        for &a in out["final_angle_state"].data() {
            assert!((0.0..TAU).contains(&a), "{a}");
        }
    }
}

/// An f64 model of the chunked algorithm the kernels run (shifted-state form, per-chunk passes),
/// checked against the sequential reference. It documents the kernels' math in plain loops.
#[cfg(test)]
#[allow(clippy::needless_range_loop)] // index loops mirror the kernels' chunk arithmetic
mod chunked_model {
    use super::*;

    struct Chunked {
        p: SisoProblem,
        out: Vec<f64>,
        finals: [Vec<f64>; 4],
        grads: TensorMap<f64>,
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    fn wrap(x: f64) -> f64 {
        x.rem_euclid(TAU)
    }

    fn run(p: &SisoProblem, inputs: &TensorMap<f64>) -> Chunked {
        let x = Inputs::new(p, inputs);
        let (n, pd, s, l, qz) = (p.state, p.head_dim, p.rope, p.length, p.chunk);
        let nc = p.chunks();
        let dout = inputs["dout"].data();
        let dfin: [Option<&[f64]>; 4] = ["dfinal_angle_state", "dfinal_ssm_state", "dfinal_k_state", "dfinal_v_state"]
            .map(|name| inputs.get(name).map(|t| t.data()));
        let mut out = vec![0.0; p.batch * l * p.heads * pd];
        let mut finals = [vec![], vec![], vec![], vec![]];
        let zero = |shape: Vec<usize>| Tensor::<f64>::zeros(shape);
        let mut grads = TensorMap::new();
        for (name, shape) in [
            ("dq", vec![p.batch, l, p.groups, n]),
            ("dk", vec![p.batch, l, p.groups, n]),
            ("dv", vec![p.batch, l, p.heads, pd]),
            ("dz", vec![p.batch, l, p.heads, pd]),
            ("dadt", vec![p.batch, p.heads, l]),
            ("ddt", vec![p.batch, p.heads, l]),
            ("dtrap", vec![p.batch, p.heads, l]),
            ("dq_bias", vec![p.heads, n]),
            ("dk_bias", vec![p.heads, n]),
            ("dangles", vec![p.batch, l, p.heads, s]),
            ("dd", vec![p.heads]),
            ("dangle_state", vec![p.batch, p.heads, s]),
            ("dssm_state", vec![p.batch, p.heads, pd, n]),
            ("dk_state", vec![p.batch, p.heads, n]),
            ("dv_state", vec![p.batch, p.heads, pd]),
        ] {
            grads.insert(name.to_string(), zero(shape));
        }
        macro_rules! g {
            ($name:expr) => {
                grads.get_mut($name).unwrap().data_mut()
            };
        }
        for b in 0..p.batch {
            for h in 0..p.heads {
                let bh = b * p.heads + h;
                let grp = h / p.heads_per_group();
                let d = x.d.map_or(0.0, |d| d[h]);
                let mu = |t: usize| {
                    let i = x.bht(b, h, t);
                    (1.0 - sigmoid(x.trap[i])) * x.dt[i]
                };
                // prep: local cumulative decay, scale, gamma, local angle cumsum
                let mut acs = vec![0.0; l];
                let mut scale = vec![0.0; l];
                let mut gamma = vec![0.0; l];
                let mut theta_loc = vec![0.0; l * s];
                let mut sums = vec![vec![0.0; s]; nc];
                for c in 0..nc {
                    let (c0, c1) = (c * qz, ((c + 1) * qz).min(l));
                    let mut a = 0.0;
                    let mut th = vec![0.0; s];
                    for t in c0..c1 {
                        let i = x.bht(b, h, t);
                        a += x.adt[i];
                        acs[t] = a;
                        gamma[t] = sigmoid(x.trap[i]) * x.dt[i];
                        scale[t] = gamma[t] + if t + 1 < l { mu(t + 1) } else { 0.0 };
                        for r in 0..s {
                            th[r] += PI * x.angles[x.blh(b, t, h, s) + r].tanh() * x.dt[i];
                            theta_loc[t * s + r] = th[r];
                        }
                    }
                    sums[c] = th;
                }
                // angle pass
                let mut theta_start = vec![vec![0.0; s]; nc + 1];
                if let Some(st) = &x.states {
                    theta_start[0] = st[0][bh * s..][..s].iter().map(|&a| wrap(a)).collect();
                }
                for c in 0..nc {
                    theta_start[c + 1] = (0..s).map(|r| wrap(theta_start[c][r] + sums[c][r])).collect();
                }
                let qk_rot = |t: usize, which: &[f64]| {
                    let c = t / qz;
                    let mut u: Vec<f64> = (0..n)
                        .map(|j| {
                            which[x.blg(b, t, grp) + j]
                                + if std::ptr::eq(which, x.q) { x.q_bias[h * n + j] } else { x.k_bias[h * n + j] }
                        })
                        .collect();
                    let th: Vec<f64> = (0..s).map(|r| theta_start[c][r] + theta_loc[t * s + r]).collect();
                    rotate(&mut u, &th);
                    u
                };
                let qt: Vec<Vec<f64>> = (0..l).map(|t| qk_rot(t, x.q)).collect();
                let kt: Vec<Vec<f64>> = (0..l).map(|t| qk_rot(t, x.k)).collect();
                let vv = |t: usize| &x.v[x.blh(b, t, h, pd)..][..pd];
                let last = |c: usize| ((c + 1) * qz).min(l) - 1;
                // chunk states
                let mut states = vec![vec![0.0; pd * n]; nc + 1];
                if let Some(st) = &x.states {
                    let m0 = mu(0);
                    for a in 0..pd {
                        for j in 0..n {
                            states[0][a * n + j] =
                                st[1][bh * pd * n + a * n + j] + m0 * st[3][bh * pd + a] * st[2][bh * n + j];
                        }
                    }
                }
                for c in 0..nc {
                    let al = acs[last(c)];
                    let mut next: Vec<f64> = states[c].iter().map(|e| al.exp() * e).collect();
                    for t in c * qz..=last(c) {
                        let w = (al - acs[t]).exp() * scale[t];
                        for a in 0..pd {
                            for j in 0..n {
                                next[a * n + j] += w * vv(t)[a] * kt[t][j];
                            }
                        }
                    }
                    states[c + 1] = next;
                }
                finals[0].extend_from_slice(&theta_start[nc]);
                finals[1].extend_from_slice(&states[nc]);
                finals[2].extend_from_slice(&kt[l - 1]);
                finals[3].extend_from_slice(vv(l - 1));
                // outputs and g
                let mut y_inter = vec![vec![0.0; pd]; l];
                let mut y_intra = vec![vec![0.0; pd]; l];
                let mut y = vec![vec![0.0; pd]; l];
                let mut gv = vec![vec![0.0; pd]; l];
                for c in 0..nc {
                    for t in c * qz..=last(c) {
                        let qkd = dot(&qt[t], &kt[t]);
                        for a in 0..pd {
                            y_inter[t][a] = acs[t].exp() * dot(&states[c][a * n..][..n], &qt[t]);
                            for j in c * qz..t {
                                y_intra[t][a] += (acs[t] - acs[j]).exp() * scale[j] * dot(&qt[t], &kt[j]) * vv(j)[a];
                            }
                            y[t][a] = y_inter[t][a] + y_intra[t][a] + (gamma[t] * qkd + d) * vv(t)[a];
                            let row = x.blh(b, t, h, pd) + a;
                            match x.z {
                                Some(z) => {
                                    out[row] = y[t][a] * silu(z[row]);
                                    gv[t][a] = dout[row] * silu(z[row]);
                                    g!("dz")[row] = dout[row] * y[t][a] * silu_derivative(z[row]);
                                }
                                None => {
                                    out[row] = y[t][a];
                                    gv[t][a] = dout[row];
                                }
                            }
                        }
                    }
                }
                // dS_loc and the reverse state pass: dstates[c] = gradient of the state leaving chunk c
                let mut dstates = vec![vec![0.0; pd * n]; nc];
                let mut running = dfin[1].map_or(vec![0.0; pd * n], |df| df[bh * pd * n..][..pd * n].to_vec());
                for c in (0..nc).rev() {
                    dstates[c] = running.clone();
                    let al = acs[last(c)];
                    let mut next: Vec<f64> = running.iter().map(|e| al.exp() * e).collect();
                    for t in c * qz..=last(c) {
                        for a in 0..pd {
                            for j in 0..n {
                                next[a * n + j] += acs[t].exp() * gv[t][a] * qt[t][j];
                            }
                        }
                    }
                    running = next;
                }
                let ds_in0 = running;
                // chunk backward: dv, dscale, dgamma, dadt, dD
                let mut dscale = vec![0.0; l];
                let mut dgamma = vec![0.0; l];
                for c in 0..nc {
                    let (c0, cl) = (c * qz, last(c));
                    let al = acs[cl];
                    let mut dacs = vec![0.0; cl + 1 - c0];
                    let mut da_last = al.exp() * dot(&dstates[c], &states[c]);
                    for t in c0..=cl {
                        let wst: Vec<f64> =
                            (0..pd).map(|a| (al - acs[t]).exp() * dot(&dstates[c][a * n..][..n], &kt[t])).collect();
                        let mut w = wst.clone();
                        for sx in t + 1..=cl {
                            let m = (acs[sx] - acs[t]).exp() * dot(&qt[sx], &kt[t]);
                            for a in 0..pd {
                                w[a] += m * gv[sx][a];
                            }
                        }
                        let qkd = dot(&qt[t], &kt[t]);
                        for a in 0..pd {
                            let row = x.blh(b, t, h, pd) + a;
                            g!("dv")[row] = scale[t] * w[a] + (gamma[t] * qkd + d) * gv[t][a];
                            if t == l - 1 {
                                if let Some(df) = dfin[3] {
                                    g!("dv")[row] += df[bh * pd + a];
                                }
                            }
                        }
                        dscale[t] = dot(vv(t), &w);
                        let gdotv = dot(&gv[t], vv(t));
                        dgamma[t] = dscale[t] + qkd * gdotv;
                        g!("dd")[h] += gdotv;
                        let yy: Vec<f64> = (0..pd).map(|a| y_inter[t][a] + y_intra[t][a]).collect();
                        dacs[t - c0] = dot(&gv[t], &yy) - scale[t] * dscale[t];
                        da_last += scale[t] * dot(vv(t), &wst);
                    }
                    *dacs.last_mut().unwrap() += da_last;
                    let mut acc = 0.0;
                    for t in (c0..=cl).rev() {
                        acc += dacs[t - c0];
                        g!("dadt")[x.bht(b, h, t)] = acc;
                    }
                }
                // dq, dk, dθ
                let mut dtheta = vec![0.0; l * s];
                for c in 0..nc {
                    let (c0, cl) = (c * qz, last(c));
                    let al = acs[cl];
                    for t in c0..=cl {
                        let mut dq_rot = vec![0.0; n];
                        let mut dk_rot = vec![0.0; n];
                        for j in 0..n {
                            dq_rot[j] = acs[t].exp() * (0..pd).map(|a| gv[t][a] * states[c][a * n + j]).sum::<f64>();
                            let mut acc =
                                (al - acs[t]).exp() * (0..pd).map(|a| vv(t)[a] * dstates[c][a * n + j]).sum::<f64>();
                            for jj in c0..t {
                                dq_rot[j] += (acs[t] - acs[jj]).exp() * scale[jj] * dot(&gv[t], vv(jj)) * kt[jj][j];
                            }
                            for sx in t + 1..=cl {
                                acc += (acs[sx] - acs[t]).exp() * dot(&gv[sx], vv(t)) * qt[sx][j];
                            }
                            dk_rot[j] = scale[t] * acc;
                        }
                        if t == l - 1 {
                            if let Some(df) = dfin[2] {
                                for j in 0..n {
                                    dk_rot[j] += df[bh * n + j];
                                }
                            }
                        }
                        let th: Vec<f64> = (0..s).map(|r| theta_start[c][r] + theta_loc[t * s + r]).collect();
                        let qraw: Vec<f64> = (0..n).map(|j| x.q[x.blg(b, t, grp) + j] + x.q_bias[h * n + j]).collect();
                        let kraw: Vec<f64> = (0..n).map(|j| x.k[x.blg(b, t, grp) + j] + x.k_bias[h * n + j]).collect();
                        let gvd = gamma[t] * dot(&gv[t], vv(t));
                        let mut dqp: Vec<f64> = (0..n).map(|j| dq_rot[j] + gvd * kraw[j]).collect();
                        let mut dkp: Vec<f64> = (0..n).map(|j| dk_rot[j] + gvd * qraw[j]).collect();
                        for r in 0..s {
                            let (sn, cs) = wrap(th[r]).sin_cos();
                            let mut angle = 0.0;
                            for (raw, grad, o) in [(&qraw, &dq_rot, &mut dqp), (&kraw, &dk_rot, &mut dkp)] {
                                let (u0, u1) = (raw[2 * r], raw[2 * r + 1]);
                                let (g0, g1) = (grad[2 * r], grad[2 * r + 1]);
                                o[2 * r] += cs * g0 + sn * g1 - g0;
                                o[2 * r + 1] += -sn * g0 + cs * g1 - g1;
                                angle += g0 * (-sn * u0 - cs * u1) + g1 * (cs * u0 - sn * u1);
                            }
                            dtheta[t * s + r] = angle;
                        }
                        let qrow = x.blg(b, t, grp);
                        for j in 0..n {
                            g!("dq")[qrow + j] += dqp[j];
                            g!("dk")[qrow + j] += dkp[j];
                            g!("dq_bias")[h * n + j] += dqp[j];
                            g!("dk_bias")[h * n + j] += dkp[j];
                        }
                    }
                }
                // angle suffix, state gradients, tail
                let mut carry = vec![vec![0.0; s]; nc];
                let mut run_s = dfin[0].map_or(vec![0.0; s], |df| df[bh * s..][..s].to_vec());
                for c in (0..nc).rev() {
                    carry[c] = run_s.clone();
                    for t in c * qz..=last(c) {
                        for r in 0..s {
                            run_s[r] += dtheta[t * s + r];
                        }
                    }
                }
                let mut dmu0 = 0.0;
                if let Some(st) = &x.states {
                    let (kin, vin) = (&st[2][bh * n..][..n], &st[3][bh * pd..][..pd]);
                    let m0 = mu(0);
                    g!("dangle_state")[bh * s..][..s].copy_from_slice(&run_s);
                    g!("dssm_state")[bh * pd * n..][..pd * n].copy_from_slice(&ds_in0);
                    for a in 0..pd {
                        let dk_in = dot(&ds_in0[a * n..][..n], kin);
                        g!("dv_state")[bh * pd + a] = m0 * dk_in;
                        dmu0 += vin[a] * dk_in;
                    }
                    for j in 0..n {
                        g!("dk_state")[bh * n + j] = m0 * (0..pd).map(|a| ds_in0[a * n + j] * vin[a]).sum::<f64>();
                    }
                }
                for c in 0..nc {
                    let mut phi = carry[c].clone();
                    for t in (c * qz..=last(c)).rev() {
                        let i = x.bht(b, h, t);
                        let mut angle_dt = 0.0;
                        for r in 0..s {
                            phi[r] += dtheta[t * s + r];
                            let th = x.angles[x.blh(b, t, h, s) + r].tanh();
                            g!("dangles")[x.blh(b, t, h, s) + r] = phi[r] * PI * x.dt[i] * (1.0 - th * th);
                            angle_dt += phi[r] * PI * th;
                        }
                        let lambda = sigmoid(x.trap[i]);
                        let dmu = if t > 0 { dscale[t - 1] } else { dmu0 };
                        g!("ddt")[i] = lambda * dgamma[t] + (1.0 - lambda) * dmu + angle_dt;
                        g!("dtrap")[i] = x.dt[i] * (dgamma[t] - dmu) * lambda * (1.0 - lambda);
                    }
                }
            }
        }
        Chunked { p: p.clone(), out, finals, grads }
    }

    #[test]
    fn chunked_model_matches_sequential_reference() {
        for (chunk, length, states, z, d) in [
            (4, 11, true, true, true),
            (3, 7, false, false, true),
            (5, 5, true, false, false),
            (8, 1, true, true, true),
        ] {
            let shape = SisoShape {
                batch: 2,
                length,
                heads: 4,
                groups: 2,
                state: 8,
                head_dim: 3,
                rope: 3,
                chunk,
                d,
                z,
                states,
                final_grads: true,
            };
            let p = SisoProblem {
                batch: 2,
                length,
                heads: 4,
                groups: 2,
                state: 8,
                head_dim: 3,
                rope: 3,
                chunk,
                has_d: d,
                has_z: z,
                has_states: states,
                has_dfinal: [true; 4],
                save_for_backward: false,
                has_chunk_states: false,
                has_ungated_out: false,
            };
            let (inputs, _) = example_inputs(&shape, true, 17);
            let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
            let model = run(&p, &wide);
            let fwd = reference_forward(&model.p, &wide);
            let bwd = reference_backward(&model.p, &wide);
            let close = |name: &str, a: &[f64], b: &[f64]| {
                let scale = b.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
                let err = a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
                assert!(err < 1e-12, "chunk {chunk} length {length}: {name} differs by {err:e}");
            };
            close("out", &model.out, fwd["out"].data());
            for (i, name) in FINAL_STATES.iter().enumerate() {
                close(name, &model.finals[i], fwd[*name].data());
            }
            for (name, want) in &bwd {
                close(name, model.grads[name].data(), want.data());
            }
        }
    }
}
