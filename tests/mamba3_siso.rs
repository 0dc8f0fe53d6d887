//! Mamba-3 SISO scan forward and backward against the reference on every backend, state
//! continuation across calls, the chain with `mamba3_preprocess`, determinism and refusals.

mod common;

use common::{
    assert_deterministic, assert_refused, check_against_reference, GRADIENT, PARAMETER_GRADIENT, SCAN_FORWARD,
};
use mamba_kernels::ops::mamba3_preprocess::{self, PreprocessShape};
use mamba_kernels::ops::mamba3_siso::{
    example_inputs, SisoShape, CHUNK_STATES, FINAL_STATES, INPUT_STATES, UNGATED_OUT,
};
use mamba_kernels::random::Rng;
use mamba_kernels::testing::{bitwise_equal, relative_error};
use mamba_kernels::{ops, Device, Scalars, Tensor, TensorMap};

const FORWARD_OP: &str = "mamba3_siso_fwd";
const BACKWARD_OP: &str = "mamba3_siso_bwd";
const DFINAL: [&str; 4] = ["dfinal_angle_state", "dfinal_ssm_state", "dfinal_k_state", "dfinal_v_state"];
const DSTATES: [&str; 4] = ["dangle_state", "dssm_state", "dk_state", "dv_state"];

/// spec/ops.md: scan outputs 2e-5, gradients 1e-4, sums over batch and time 3e-4.
fn tolerance(name: &str) -> f64 {
    match name {
        "out" | "final_angle_state" | "final_ssm_state" | "final_k_state" | "final_v_state" | CHUNK_STATES
        | UNGATED_OUT => SCAN_FORWARD,
        "dq_bias" | "dk_bias" | "dd" => PARAMETER_GRADIENT,
        _ => GRADIENT,
    }
}

#[allow(clippy::too_many_arguments)]
fn shape(
    batch: usize,
    length: usize,
    heads: usize,
    groups: usize,
    state: usize,
    head_dim: usize,
    rope: usize,
    chunk: usize,
    [d, z, states, final_grads]: [bool; 4],
) -> SisoShape {
    SisoShape { batch, length, heads, groups, state, head_dim, rope, chunk, d, z, states, final_grads }
}

const ALL: [bool; 4] = [true; 4];
const NONE: [bool; 4] = [false; 4];

/// Every value of the matrix appears at least once (not every combination):
/// B {1, 2}; L {1, 2, 63, 64, 65, 131, 2345}; (H, G) with H ∈ {1, 4, 8}, G ∈ {1, 2, 4};
/// N {8, 16, 32, 128}; P {4, 16, 64}; S {1, N/4, N/2}; chunk {16, 64}; d, z, the input states and
/// the final-state gradients each on and off. The L = 2345 case keeps P and N small; the
/// realistic N = 128, P = 64 shape runs at L = 64, 65 and 131: full 64-step chunks take the kernels'
/// unchecked ("regular") staging, with and without z (L = 64 has no z). The last case has P·N = 18
/// (N = 6, P = 3).
fn cases() -> Vec<SisoShape> {
    vec![
        shape(1, 1, 1, 1, 8, 4, 1, 64, ALL),
        shape(2, 2, 4, 2, 16, 16, 4, 16, [false, true, false, false]),
        shape(1, 63, 8, 4, 32, 4, 16, 64, [true, false, true, true]),
        shape(2, 64, 4, 4, 128, 64, 32, 64, [false, false, false, true]),
        shape(1, 65, 8, 1, 128, 64, 32, 64, ALL),
        shape(2, 131, 4, 1, 16, 16, 8, 16, [true, true, false, false]),
        shape(1, 131, 8, 2, 128, 16, 64, 64, [false, true, true, false]),
        shape(2, 2345, 4, 2, 8, 4, 2, 64, ALL),
        shape(1, 100, 1, 1, 32, 4, 1, 16, NONE),
        // P·N = 18 is not a multiple of 4: the kernels' per-element paths (no 16-byte accesses)
        shape(1, 70, 2, 1, 6, 3, 1, 16, ALL),
    ]
}

fn forward_and_backward_match_reference(device: &Device) {
    for (i, s) in cases().iter().enumerate() {
        let case = format!("{s:?}");
        for (backward, op) in [(false, FORWARD_OP), (true, BACKWARD_OP)] {
            let (inputs, scalars) = example_inputs(s, backward, 100 + i as u64);
            check_against_reference(device, op, &inputs, &scalars, &tolerance, &case);
        }
    }
}

/// Three full chunks at N = 128, P = 64: on Vulkan the fused walks' loader-warp form
/// (`mamba3_siso_state_scan_ws`, taken where every tile and chunk is regular); both ops are also
/// checked for bitwise repeatability (run on the fused-states devices only; the other paths see full
/// chunks in `cases`). On CUDA the walks take the general path for every chunk
/// (`target_is_cuda`), which this checks there instead.
///
/// The shape runs twice: as generated, and with the decays weakened 100-fold. With the examples'
/// decays a 64-step chunk keeps about e^-11 of its input state, so the terms through the chunk
/// states (d(A_last)'s ⟨dS_out, S_in⟩ among them) are below the tolerance; weakened, they weigh as
/// much as the in-chunk ones.
fn full_chunks_match_reference(device: &Device) {
    let s = shape(1, 192, 2, 1, 128, 64, 32, 64, ALL);
    for weak_decay in [false, true] {
        for op in [FORWARD_OP, BACKWARD_OP] {
            let (mut inputs, scalars) = example_inputs(&s, op == BACKWARD_OP, 17);
            if weak_decay {
                let adt = inputs.get_mut("adt").expect("the SISO examples have adt");
                adt.data_mut().iter_mut().for_each(|x| *x *= 0.01);
            }
            let case = format!("{s:?}, decays weakened: {weak_decay}");
            check_against_reference(device, op, &inputs, &scalars, &tolerance, &case);
            assert_deterministic(device, op, &inputs, &scalars, 3);
        }
    }
}

/// chunk_size is a tuning knob: other chunk sizes (also one that divides nothing) agree with the
/// sequential reference just as well.
fn chunk_size_only_tunes(device: &Device) {
    for chunk in [1, 13, 32, 64] {
        let s = shape(2, 77, 4, 2, 16, 8, 4, chunk, ALL);
        for (backward, op) in [(false, FORWARD_OP), (true, BACKWARD_OP)] {
            let (inputs, scalars) = example_inputs(&s, backward, 7);
            check_against_reference(device, op, &inputs, &scalars, &tolerance, &format!("chunk {chunk}"));
        }
    }
}

/// Saved for the backward: the forward's `chunk_states` and `ungated_out` (with
/// `save_for_backward`) match the reference's states entering every chunk and y before the gate, and saving changes
/// none of the other outputs. The backward given the chunk states returns bitwise what it returns
/// when it recomputes them (the same walk, run once instead of twice); given y before the gate as
/// well (the forward's, or `out` without z), it matches the reference, reads both, and repeats
/// bitwise, and given y alone it returns bitwise what it returns given both. Shapes: regular chunks at N = 128, P = 64 with weakened decays (the loader-warp walk on
/// Vulkan, and states that carry weight into the next chunk), ragged chunks of 16 with input
/// states, and the per-element paths (P·N = 18) with no optional inputs.
fn saved_for_backward_is_reused(device: &Device) {
    let shapes = [
        shape(1, 192, 2, 1, 128, 64, 32, 64, ALL),
        shape(2, 77, 4, 2, 16, 8, 4, 16, ALL),
        shape(1, 70, 2, 1, 6, 3, 1, 16, NONE),
    ];
    for (i, s) in shapes.iter().enumerate() {
        let case = format!("{s:?}");
        let (mut inputs, scalars) = example_inputs(s, true, 60 + i as u64);
        if i == 0 {
            let adt = inputs.get_mut("adt").expect("the SISO examples have adt");
            adt.data_mut().iter_mut().for_each(|x| *x *= 0.01);
        }
        let mut forward_inputs = inputs.clone();
        forward_inputs.remove("dout");
        DFINAL.iter().for_each(|name| _ = forward_inputs.remove(*name));
        let saving = scalars.clone().with("save_for_backward", 1);
        let forward = check_against_reference(device, FORWARD_OP, &forward_inputs, &saving, &tolerance, &case);
        let plain = ops::run(device, FORWARD_OP, &forward_inputs, &scalars).expect("forward without saving");
        for (name, tensor) in &plain {
            assert!(bitwise_equal(tensor, &forward[name]), "[{case}] `{name}` changes when the states are saved");
        }
        let recomputed = ops::run(device, BACKWARD_OP, &inputs, &scalars).expect("backward");
        let mut both_saved = inputs.clone();
        inputs.insert(CHUNK_STATES.into(), forward[CHUNK_STATES].clone());
        let reused = ops::run(device, BACKWARD_OP, &inputs, &scalars).expect("backward with chunk_states");
        assert_eq!(reused.keys().collect::<Vec<_>>(), recomputed.keys().collect::<Vec<_>>());
        for (name, tensor) in &recomputed {
            assert!(
                bitwise_equal(tensor, &reused[name]),
                "{BACKWARD_OP} [{case}] on {}: `{name}` differs between saved and recomputed chunk states",
                device.kind()
            );
        }
        // and the GPU backward reads them (the CPU reference recomputes whatever it is given)
        if device.gpu().is_some() {
            let states = inputs.get_mut(CHUNK_STATES).expect("inserted above");
            states.data_mut().iter_mut().for_each(|x| *x = 2.0 * *x + 1.0);
            let altered = ops::run(device, BACKWARD_OP, &inputs, &scalars).expect("backward with altered states");
            assert!(!bitwise_equal(&altered["dq"], &recomputed["dq"]), "[{case}] `chunk_states` was not read");
        }

        let ungated = if s.z { &forward[UNGATED_OUT] } else { &forward["out"] };
        both_saved.insert(CHUNK_STATES.into(), forward[CHUNK_STATES].clone());
        both_saved.insert(UNGATED_OUT.into(), ungated.clone());
        let case = format!("{case}, chunk states and y saved");
        let with_both = check_against_reference(device, BACKWARD_OP, &both_saved, &scalars, &tolerance, &case);
        assert_deterministic(device, BACKWARD_OP, &both_saved, &scalars, 2);
        // y alone: the states recomputed are the saved ones bit for bit, so the gradients are too
        let mut y_only = both_saved.clone();
        y_only.remove(CHUNK_STATES);
        let with_y = ops::run(device, BACKWARD_OP, &y_only, &scalars).expect("backward with y saved");
        for (name, tensor) in &with_both {
            assert!(bitwise_equal(tensor, &with_y[name]), "[{case}] `{name}` differs without `chunk_states`");
        }
        if device.gpu().is_some() {
            let before = ops::run(device, BACKWARD_OP, &both_saved, &scalars).expect("backward with y saved");
            let y = both_saved.get_mut(UNGATED_OUT).expect("inserted above");
            y.data_mut().iter_mut().for_each(|x| *x = 2.0 * *x + 1.0);
            let altered = ops::run(device, BACKWARD_OP, &both_saved, &scalars).expect("backward with altered y");
            assert!(!bitwise_equal(&altered["dadt"], &before["dadt"]), "[{case}] `ungated_out` was not read");
        }
    }
}

// ---- state continuation ----

/// Slices steps [from, to) of a tensor whose axis `axis` is time.
fn slice_time(t: &Tensor, axis: usize, from: usize, to: usize) -> Tensor {
    let shape = t.shape();
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut data = Vec::with_capacity(outer * (to - from) * inner);
    for o in 0..outer {
        let base = o * shape[axis] * inner;
        data.extend_from_slice(&t.data()[base + from * inner..base + to * inner]);
    }
    let mut new_shape = shape.to_vec();
    new_shape[axis] = to - from;
    Tensor::new(new_shape, data).expect("slice")
}

/// Concatenates along time axis `axis`.
fn concat_time(parts: &[Tensor], axis: usize) -> Tensor {
    let shape = parts[0].shape();
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let total: usize = parts.iter().map(|p| p.shape()[axis]).sum();
    let mut data = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for p in parts {
            let len = p.shape()[axis] * inner;
            data.extend_from_slice(&p.data()[o * len..(o + 1) * len]);
        }
    }
    let mut new_shape = shape.to_vec();
    new_shape[axis] = total;
    Tensor::new(new_shape, data).expect("concat")
}

/// The time axis of every per-step input and gradient.
fn time_axis(name: &str) -> Option<usize> {
    match name {
        "q" | "k" | "v" | "z" | "angles" | "dout" | "out" | "dq" | "dk" | "dv" | "dz" | "dangles" => Some(1),
        "adt" | "dt" | "trap" | "dadt" | "ddt" | "dtrap" => Some(2),
        _ => None,
    }
}

fn add(a: &Tensor, b: &Tensor) -> Tensor {
    Tensor::new(a.shape().to_vec(), a.data().iter().zip(b.data()).map(|(x, y)| x + y).collect()).expect("add")
}

/// Runs forward and backward over the steps split at `cuts`, carrying the four states forward and
/// the four state gradients backward; returns what one call over all steps returns.
fn run_in_pieces(
    device: &Device,
    inputs: &TensorMap,
    scalars: &Scalars,
    length: usize,
    pieces: &[usize],
) -> (TensorMap, TensorMap) {
    assert_eq!(pieces.iter().sum::<usize>(), length);
    let mut bounds = vec![0];
    for p in pieces {
        bounds.push(bounds.last().unwrap() + p);
    }
    let piece_inputs = |k: usize, states: &TensorMap, dfinal: Option<&TensorMap>| -> TensorMap {
        let mut map = TensorMap::new();
        for (name, t) in inputs {
            if INPUT_STATES.contains(&name.as_str()) || DFINAL.contains(&name.as_str()) {
                continue;
            }
            if name == "dout" && dfinal.is_none() {
                continue;
            }
            let value = match time_axis(name) {
                Some(axis) => slice_time(t, axis, bounds[k], bounds[k + 1]),
                None => t.clone(),
            };
            map.insert(name.clone(), value);
        }
        map.extend(states.iter().map(|(k, v)| (k.clone(), v.clone())));
        if let Some(df) = dfinal {
            map.extend(df.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        map
    };
    // forward, keeping the states entering every piece
    let mut states: TensorMap = INPUT_STATES.iter().map(|n| (n.to_string(), inputs[*n].clone())).collect();
    let mut entering = Vec::new();
    let mut outs = Vec::new();
    let mut forward = TensorMap::new();
    for k in 0..pieces.len() {
        entering.push(states.clone());
        let result = ops::run(device, FORWARD_OP, &piece_inputs(k, &states, None), scalars).expect("forward piece");
        outs.push(result["out"].clone());
        states = INPUT_STATES.iter().zip(FINAL_STATES).map(|(i, f)| (i.to_string(), result[f].clone())).collect();
        forward = result;
    }
    forward.insert("out".into(), concat_time(&outs, 1));
    // backward, last piece first
    let mut dfinal: TensorMap = DFINAL.iter().map(|n| (n.to_string(), inputs[*n].clone())).collect();
    let mut pieces_grads: Vec<TensorMap> = Vec::new();
    for k in (0..pieces.len()).rev() {
        let result = ops::run(device, BACKWARD_OP, &piece_inputs(k, &entering[k], Some(&dfinal)), scalars)
            .expect("backward piece");
        dfinal = DFINAL.iter().zip(DSTATES).map(|(f, d)| (f.to_string(), result[d].clone())).collect();
        pieces_grads.push(result);
    }
    pieces_grads.reverse();
    let mut backward = TensorMap::new();
    for name in pieces_grads[0].keys() {
        let parts: Vec<Tensor> = pieces_grads.iter().map(|g| g[name].clone()).collect();
        let merged = match time_axis(name) {
            Some(axis) => concat_time(&parts, axis),
            None if DSTATES.contains(&name.as_str()) => parts[0].clone(),
            None => parts[1..].iter().fold(parts[0].clone(), |acc, p| add(&acc, p)),
        };
        backward.insert(name.clone(), merged);
    }
    (forward, backward)
}

fn compare_with_reference(
    device: &Device,
    inputs: &TensorMap,
    scalars: &Scalars,
    got: (&TensorMap, &TensorMap),
    case: &str,
) {
    let cpu = Device::cpu();
    let forward_inputs: TensorMap = inputs
        .iter()
        .filter(|(k, _)| *k != "dout" && !DFINAL.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let want_forward = ops::run(&cpu, FORWARD_OP, &forward_inputs, scalars).expect("reference forward");
    let want_backward = ops::run(&cpu, BACKWARD_OP, inputs, scalars).expect("reference backward");
    for (want, got) in [(&want_forward, got.0), (&want_backward, got.1)] {
        assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{case}: outputs differ");
        for (name, reference) in want {
            // the sums over time of dq_bias, dk_bias and dd add one rounding per piece
            let limit = tolerance(name);
            let error = relative_error(&got[name], reference);
            assert!(error <= limit, "{case} on {}: `{name}` error {error:.3e} > {limit:.1e}", device.kind());
        }
    }
}

/// A run over L1 steps then L2 steps with the states carried equals one run over L1 + L2, forward
/// and backward (the second half's input-state gradients are the first half's final-state gradients).
fn state_continuation(device: &Device) {
    for (s, split) in [(shape(2, 150, 4, 2, 16, 16, 8, 64, ALL), 70), (shape(1, 40, 2, 1, 32, 4, 4, 16, ALL), 16)] {
        let (inputs, scalars) = example_inputs(&s, true, 31);
        let (forward, backward) = run_in_pieces(device, &inputs, &scalars, s.length, &[split, s.length - split]);
        compare_with_reference(device, &inputs, &scalars, (&forward, &backward), &format!("{s:?} split at {split}"));
    }
}

/// Single steps (L = 1 calls) carried one after another equal the chunked run.
fn single_steps_equal_chunked_run(device: &Device) {
    let s = shape(2, 24, 4, 2, 16, 8, 4, 16, ALL);
    let (inputs, scalars) = example_inputs(&s, true, 32);
    let (forward, backward) = run_in_pieces(device, &inputs, &scalars, s.length, &[1; 24]);
    compare_with_reference(device, &inputs, &scalars, (&forward, &backward), "single steps");
    // and the device's own chunked run agrees with the single steps
    let chunked = ops::run(device, BACKWARD_OP, &inputs, &scalars).expect("chunked backward");
    for (name, t) in &chunked {
        let error = relative_error(&backward[name], t);
        assert!(error <= tolerance(name), "single steps vs chunked run: `{name}` error {error:.3e}");
    }
}

// ---- composition with mamba3_preprocess ----

/// Column slice [from, from + width) of a [rows, total] matrix.
fn columns(t: &Tensor, from: usize, width: usize) -> Vec<f32> {
    let total = t.shape()[1];
    (0..t.shape()[0]).flat_map(|r| t.data()[r * total + from..r * total + from + width].to_vec()).collect()
}

/// [B·L, H] (rows b·L + t) to [B, H, L], and back.
fn rows_to_bhl(data: &[f32], b: usize, l: usize, h: usize) -> Tensor {
    Tensor::from_fn(vec![b, h, l], |i| {
        let (bb, hh, tt) = (i / (h * l), (i / l) % h, i % l);
        data[(bb * l + tt) * h + hh]
    })
}

fn bhl_to_rows(t: &Tensor, b: usize, l: usize, h: usize) -> Tensor {
    Tensor::from_fn(vec![b * l, h], |i| {
        let (row, hh) = (i / h, i % h);
        let (bb, tt) = (row / l, row % l);
        t.data()[(bb * h + hh) * l + tt]
    })
}

/// `mamba3_preprocess_fwd` → `mamba3_siso_fwd` → Σ w·out, and back through both backwards.
/// Returns every output and gradient of the chain.
fn preprocess_siso_chain(device: &Device, s: &SisoShape, seed: u64) -> TensorMap {
    let (b, l, h, g, n, pd, sr) = (s.batch, s.length, s.heads, s.groups, s.state, s.head_dim, s.rope);
    let pre_shape = PreprocessShape {
        rows: b * l,
        inner: h * pd,
        state: n,
        heads: h,
        bc_rows: g,
        rope_angles: sr,
        norm_weights: true,
        dt_clamp: None,
    };
    let (pre_inputs, pre_scalars) = mamba3_preprocess::example_inputs(&pre_shape, false, seed);
    let pre = ops::run(device, "mamba3_preprocess_fwd", &pre_inputs, &pre_scalars).expect("preprocess forward");
    let projected = &pre_inputs["projected"];
    let inner = h * pd;
    let trap_offset = 2 * inner + 2 * g * n + 2 * h;
    let angle_offset = trap_offset + h;
    let mut rng = Rng::new(seed + 1);
    let mut siso = TensorMap::new();
    siso.insert("q".into(), Tensor::new(vec![b, l, g, n], pre["ch"].data().to_vec()).unwrap());
    siso.insert("k".into(), Tensor::new(vec![b, l, g, n], pre["bh"].data().to_vec()).unwrap());
    siso.insert("z".into(), Tensor::new(vec![b, l, h, pd], columns(projected, 0, inner)).unwrap());
    siso.insert("v".into(), Tensor::new(vec![b, l, h, pd], columns(projected, inner, inner)).unwrap());
    siso.insert("adt".into(), rows_to_bhl(pre["adt"].data(), b, l, h));
    siso.insert("dt".into(), rows_to_bhl(pre["dt"].data(), b, l, h));
    siso.insert("trap".into(), rows_to_bhl(&columns(projected, trap_offset, h), b, l, h));
    let angles = columns(projected, angle_offset, sr);
    siso.insert(
        "angles".into(),
        Tensor::from_fn(vec![b, l, h, sr], |i| angles[(i / (h * sr)) * sr + i % sr]), // broadcast over heads
    );
    siso.insert("q_bias".into(), rng.uniform_tensor(vec![h, n], 0.5, 1.5));
    siso.insert("k_bias".into(), rng.uniform_tensor(vec![h, n], 0.5, 1.5));
    siso.insert("d".into(), rng.uniform_tensor(vec![h], 0.5, 1.5));
    let scalars = Scalars::new().with("chunk_size", s.chunk);
    let forward = ops::run(device, FORWARD_OP, &siso, &scalars).expect("siso forward");
    siso.insert("dout".into(), rng.normal_tensor(vec![b, l, h, pd], 1.0));
    let grads = ops::run(device, BACKWARD_OP, &siso, &scalars).expect("siso backward");

    let mut pre_bwd = pre_inputs.clone();
    pre_bwd.insert("dz".into(), Tensor::new(vec![b * l, inner], grads["dz"].data().to_vec()).unwrap());
    pre_bwd.insert("dx".into(), Tensor::new(vec![b * l, inner], grads["dv"].data().to_vec()).unwrap());
    pre_bwd.insert("dbh".into(), Tensor::new(vec![b * l, g, n], grads["dk"].data().to_vec()).unwrap());
    pre_bwd.insert("dch".into(), Tensor::new(vec![b * l, g, n], grads["dq"].data().to_vec()).unwrap());
    pre_bwd.insert("ddt".into(), bhl_to_rows(&grads["ddt"], b, l, h));
    pre_bwd.insert("dadt".into(), bhl_to_rows(&grads["dadt"], b, l, h));
    pre_bwd.insert("dtrap".into(), bhl_to_rows(&grads["dtrap"], b, l, h));
    let dangles = &grads["dangles"];
    pre_bwd.insert(
        "dangles".into(),
        Tensor::from_fn(vec![b * l, sr], |i| {
            let (row, a) = (i / sr, i % sr);
            (0..h).map(|hh| dangles.data()[(row * h + hh) * sr + a]).sum() // sum over heads, in order
        }),
    );
    let pre_grads = ops::run(device, "mamba3_preprocess_bwd", &pre_bwd, &pre_scalars).expect("preprocess backward");
    let mut chain = TensorMap::new();
    chain.insert("out".into(), forward["out"].clone());
    for name in ["dq_bias", "dk_bias", "dd"] {
        chain.insert(name.into(), grads[name].clone());
    }
    chain.extend(pre_grads);
    chain
}

/// The preprocess → scan chain on the device equals the chain of CPU references.
fn composition_with_preprocess(device: &Device) {
    let s = shape(2, 70, 4, 2, 16, 8, 4, 64, [true, true, false, false]);
    let got = preprocess_siso_chain(device, &s, 41);
    let want = preprocess_siso_chain(&Device::cpu(), &s, 41);
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (name, reference) in &want {
        let limit = match name.as_str() {
            "out" => SCAN_FORWARD,
            "dq_bias" | "dk_bias" | "dd" | "ddt_bias" | "db_norm_weight" | "dc_norm_weight" => PARAMETER_GRADIENT,
            _ => GRADIENT,
        };
        let error = relative_error(&got[name], reference);
        assert!(error <= limit, "chain on {}: `{name}` error {error:.3e} > {limit:.1e}", device.kind());
    }
}

fn bitwise_deterministic(device: &Device) {
    let s = shape(2, 131, 4, 2, 32, 16, 8, 64, ALL);
    for (backward, op) in [(false, FORWARD_OP), (true, BACKWARD_OP)] {
        let (inputs, scalars) = example_inputs(&s, backward, 9);
        assert_deterministic(device, op, &inputs, &scalars, 5);
    }
}

fn bad_input_is_refused(device: &Device) {
    let base = shape(1, 10, 4, 2, 8, 4, 2, 16, ALL);
    let (inputs, scalars) = example_inputs(&base, true, 3);
    let op = BACKWARD_OP;

    let (uneven, s) = example_inputs(&SisoShape { heads: 3, ..base.clone() }, true, 3);
    assert_refused(device, op, &uneven, &s, &["`v`", "H=3", "multiple", "G=2"]);
    let (odd, s) = example_inputs(&SisoShape { state: 7, rope: 2, ..base.clone() }, true, 3);
    assert_refused(device, op, &odd, &s, &["`q`", "N=7", "even"]);
    let (wide, s) = example_inputs(&SisoShape { rope: 5, ..base.clone() }, true, 3);
    assert_refused(device, op, &wide, &s, &["`angles`", "S=5", "N/2 = 4"]);
    for missing in INPUT_STATES {
        let mut partial = inputs.clone();
        partial.remove(missing);
        assert_refused(device, op, &partial, &scalars, &[&format!("`{missing}`"), "together"]);
        assert_refused(device, FORWARD_OP, &partial, &scalars, &[&format!("`{missing}`"), "together"]);
    }
    assert_refused(
        device,
        op,
        &inputs,
        &scalars.clone().with("chunk_size", 0),
        &["`chunk_size`", "between 1 and 64", "0"],
    );
    assert_refused(device, op, &inputs, &scalars.clone().with("chunk_size", 100000), &["`chunk_size`", "100000"]);
    assert_refused(device, op, &inputs, &scalars.clone().with("chunk_size", "-3"), &["`chunk_size`", "integer"]);
    let mut no_dout = inputs.clone();
    no_dout.remove("dout");
    assert_refused(device, op, &no_dout, &scalars, &["`dout`", "missing"]);
    let mut bad_trap = inputs.clone();
    bad_trap.insert("trap".into(), Tensor::zeros(vec![1, 4, 11]));
    assert_refused(device, op, &bad_trap, &scalars, &["`trap`", "L=10"]);
    let mut stray = inputs.clone();
    stray.insert("dfinal_k".into(), Tensor::zeros(vec![1, 4, 8]));
    assert_refused(device, op, &stray, &scalars, &["`dfinal_k`", "not an input"]);
    let (forward_only, _) = example_inputs(&base, false, 3);
    assert_refused(device, FORWARD_OP, &forward_only, &scalars.clone().with("chunk_sizes", 64), &["`chunk_sizes`"]);
    assert_refused(
        device,
        FORWARD_OP,
        &forward_only,
        &scalars.clone().with("save_for_backward", 2),
        &["`save_for_backward`", "0 or 1"],
    );
    // the states entering each of the 10-step input's chunks of 16: one chunk, not two
    let mut wrong_chunks = inputs.clone();
    wrong_chunks.insert(CHUNK_STATES.into(), Tensor::zeros(vec![1, 4, 2, 4, 8]));
    assert_refused(device, op, &wrong_chunks, &scalars, &["`chunk_states`", "chunks=1", "[1, 4, 2, 4, 8]"]);
    let mut wrong_steps = inputs.clone();
    wrong_steps.insert(UNGATED_OUT.into(), Tensor::zeros(vec![1, 11, 4, 4]));
    assert_refused(device, op, &wrong_steps, &scalars, &["`ungated_out`", "L=10", "[1, 11, 4, 4]"]);
    let mut saved_into_forward = forward_only.clone();
    saved_into_forward.insert(CHUNK_STATES.into(), Tensor::zeros(vec![1, 4, 1, 4, 8]));
    assert_refused(device, FORWARD_OP, &saved_into_forward, &scalars, &["`chunk_states`", "not an input"]);
}

backend_tests!(
    forward_and_backward_match_reference,
    saved_for_backward_is_reused,
    chunk_size_only_tunes,
    state_continuation,
    single_steps_equal_chunked_run,
    composition_with_preprocess,
    bitwise_deterministic,
    bad_input_is_refused
);

tile_path_tests!(
    forward_and_backward_match_reference,
    saved_for_backward_is_reused,
    chunk_size_only_tunes,
    state_continuation,
    single_steps_equal_chunked_run,
    composition_with_preprocess,
    bitwise_deterministic,
    bad_input_is_refused
);

state_passing_tests!(
    forward_and_backward_match_reference,
    saved_for_backward_is_reused,
    full_chunks_match_reference,
    chunk_size_only_tunes,
    state_continuation,
    bitwise_deterministic
);
