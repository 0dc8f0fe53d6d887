//! Mamba-1 selective scan forward and backward against the reference on every backend.

mod common;

use common::{
    assert_deterministic, assert_refused, check_against_reference, GRADIENT, PARAMETER_GRADIENT, SCAN_FORWARD,
};
use mamba_kernels::ops::selective_scan::{example_inputs, ScanShape};
use mamba_kernels::testing::relative_error;
use mamba_kernels::{ops, Device, Tensor, TensorMap};

fn tolerance(name: &str) -> f64 {
    match name {
        "out" | "last_state" => SCAN_FORWARD,
        "da" | "dd" | "ddelta_bias" => PARAMETER_GRADIENT,
        _ => GRADIENT,
    }
}

/// (batch, dim, state, groups, length) with options (d, z, delta_bias, h0, dlast_state, softplus).
type Case = ((usize, usize, usize, usize, usize), [bool; 6]);

fn shape(case: &Case) -> ScanShape {
    let ((batch, dim, state, groups, length), [d, z, delta_bias, h0, dlast_state, delta_softplus]) = *case;
    ScanShape { batch, dim, state, groups, length, d, z, delta_bias, h0, dlast_state, delta_softplus }
}

const ALL: [bool; 6] = [true; 6];
const NONE: [bool; 6] = [false; 6];

/// Every value of the matrix appears: B {1, 2}; D {1, 4, 8, 64}; N {1, 8, 16}; G {1, 2};
/// L {1, 2, 3, 31, 32, 33, 127, 128, 129, 2047, 2048, 2049, 4100} (chunks are 128 steps, float4
/// loads need L % 4 == 0); each optional input and softplus on and off. Beyond it: N = 40 (three
/// register tiles of states, the last partial), groups wider than one workgroup (db/dc summed over
/// channel blocks), with a partial last block, and one realistic shape.
const CASES: &[Case] = &[
    ((1, 1, 1, 1, 1), NONE),
    ((2, 4, 8, 2, 2), ALL),
    ((1, 8, 16, 1, 3), [true, true, false, false, false, true]),
    ((2, 4, 16, 2, 31), [false, false, true, true, true, true]),
    ((1, 64, 16, 1, 32), ALL),
    ((2, 8, 8, 2, 33), [false, true, false, true, false, false]),
    ((1, 4, 1, 1, 127), ALL),
    ((2, 64, 16, 2, 128), [true, false, true, false, true, true]),
    ((1, 8, 16, 2, 129), ALL),
    ((1, 4, 16, 1, 2047), [true, true, true, false, false, true]),
    ((1, 1, 8, 1, 2048), [false, false, false, true, true, false]),
    ((2, 4, 16, 2, 2049), ALL),
    ((1, 1, 16, 1, 4100), ALL),
    ((1, 130, 40, 1, 300), ALL),
    ((2, 256, 16, 2, 129), [true, true, true, false, false, true]),
    ((2, 64, 16, 1, 2048), ALL),
];

fn forward_and_backward_match_reference(device: &Device) {
    for (i, case) in CASES.iter().enumerate() {
        let s = shape(case);
        let label = format!("{s:?}");
        let (inputs, scalars) = example_inputs(&s, false, 100 + i as u64);
        check_against_reference(device, "selective_scan_fwd", &inputs, &scalars, &tolerance, &label);
        let (inputs, scalars) = example_inputs(&s, true, 100 + i as u64);
        check_against_reference(device, "selective_scan_bwd", &inputs, &scalars, &tolerance, &label);
    }
}

/// Elements [start, end) of the last axis.
fn slice_last(t: &Tensor, start: usize, end: usize) -> Tensor {
    let length = *t.shape().last().expect("rank >= 1");
    let mut shape = t.shape().to_vec();
    *shape.last_mut().expect("rank >= 1") = end - start;
    let data: Vec<f32> = t.data().chunks(length).flat_map(|row| row[start..end].iter().copied()).collect();
    Tensor::new(shape, data).expect("slice size")
}

fn concat_last(a: &Tensor, b: &Tensor) -> Tensor {
    let (la, lb) = (*a.shape().last().expect("rank"), *b.shape().last().expect("rank"));
    let mut shape = a.shape().to_vec();
    *shape.last_mut().expect("rank") = la + lb;
    let data: Vec<f32> =
        a.data().chunks(la).zip(b.data().chunks(lb)).flat_map(|(x, y)| x.iter().chain(y).copied()).collect();
    Tensor::new(shape, data).expect("concat size")
}

fn add(a: &Tensor, b: &Tensor) -> Tensor {
    Tensor::new(a.shape().to_vec(), a.data().iter().zip(b.data()).map(|(x, y)| x + y).collect()).expect("same shape")
}

/// The inputs restricted to time steps [start, end), with the given initial state and dlast_state.
fn time_slice(inputs: &TensorMap, start: usize, end: usize, h0: Option<&Tensor>, dlast: Option<&Tensor>) -> TensorMap {
    let mut part = TensorMap::new();
    for (name, t) in inputs {
        match name.as_str() {
            "u" | "delta" | "z" | "dout" | "b" | "c" => {
                part.insert(name.clone(), slice_last(t, start, end));
            }
            "h0" | "dlast_state" => {}
            _ => {
                part.insert(name.clone(), t.clone());
            }
        }
    }
    if let Some(h0) = h0 {
        part.insert("h0".into(), h0.clone());
    }
    if let Some(dlast) = dlast {
        part.insert("dlast_state".into(), dlast.clone());
    }
    part
}

fn assert_close(name: &str, got: &Tensor, want: &Tensor, limit: f64, device: &Device) {
    let error = relative_error(got, want);
    assert!(error <= limit, "state continuation on {}: `{name}` error {error:.3e} > {limit:.1e}", device.kind());
}

/// Two calls with the state carried equal one call: forward (the second call's h0 is the first
/// call's last_state) and backward (the first call's dlast_state is the second call's dh0).
fn state_continuation(device: &Device) {
    let run = |op: &str, inputs: &TensorMap, scalars| {
        ops::run(device, op, inputs, scalars).unwrap_or_else(|e| panic!("{op} on {}: {e}", device.kind()))
    };
    let (length, split) = (300, 131);
    let s = ScanShape::full(2, 8, 16, 2, length);
    let (inputs, scalars) = example_inputs(&s, true, 77);
    let forward_inputs = |m: &TensorMap| -> TensorMap {
        m.iter()
            .filter(|(k, _)| k.as_str() != "dout" && k.as_str() != "dlast_state")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };

    let whole = run("selective_scan_fwd", &forward_inputs(&inputs), &scalars);
    let first_inputs = time_slice(&inputs, 0, split, inputs.get("h0"), None);
    let first = run("selective_scan_fwd", &forward_inputs(&first_inputs), &scalars);
    let second_inputs = time_slice(&inputs, split, length, Some(&first["last_state"]), inputs.get("dlast_state"));
    let second = run("selective_scan_fwd", &forward_inputs(&second_inputs), &scalars);
    assert_close("out", &concat_last(&first["out"], &second["out"]), &whole["out"], SCAN_FORWARD, device);
    assert_close("last_state", &second["last_state"], &whole["last_state"], SCAN_FORWARD, device);

    let whole = run("selective_scan_bwd", &inputs, &scalars);
    let later = run("selective_scan_bwd", &second_inputs, &scalars);
    let earlier_inputs = time_slice(&inputs, 0, split, inputs.get("h0"), Some(&later["dh0"]));
    let earlier = run("selective_scan_bwd", &earlier_inputs, &scalars);
    for name in ["du", "ddelta", "dz", "db", "dc"] {
        assert_close(name, &concat_last(&earlier[name], &later[name]), &whole[name], GRADIENT, device);
    }
    for name in ["da", "dd", "ddelta_bias"] {
        assert_close(name, &add(&earlier[name], &later[name]), &whole[name], PARAMETER_GRADIENT, device);
    }
    assert_close("dh0", &earlier["dh0"], &whole["dh0"], GRADIENT, device);
}

fn bitwise_deterministic(device: &Device) {
    let s = ScanShape::full(2, 130, 40, 2, 300);
    let (inputs, scalars) = example_inputs(&s, false, 9);
    assert_deterministic(device, "selective_scan_fwd", &inputs, &scalars, 5);
    let (inputs, scalars) = example_inputs(&s, true, 9);
    assert_deterministic(device, "selective_scan_bwd", &inputs, &scalars, 5);
}

fn bad_input_is_refused(device: &Device) {
    let op = "selective_scan_bwd";
    let s = ScanShape::full(2, 4, 8, 2, 10);
    let (inputs, scalars) = example_inputs(&s, true, 3);
    let with = |name: &str, tensor: Tensor| {
        let mut changed = inputs.clone();
        changed.insert(name.into(), tensor);
        changed
    };
    let without = |name: &str| {
        let mut changed = inputs.clone();
        changed.remove(name);
        changed
    };
    assert_refused(device, op, &with("b", Tensor::zeros(vec![2, 3, 8, 10])), &scalars, &["`b`", "groups=3", "dim=4"]);
    assert_refused(device, op, &with("c", Tensor::zeros(vec![2, 2, 8, 11])), &scalars, &["`c`", "[2, 2, 8, 10]"]);
    assert_refused(device, op, &with("delta", Tensor::zeros(vec![2, 4, 9])), &scalars, &["`delta`", "[2, 4, 10]"]);
    assert_refused(device, op, &with("a", Tensor::zeros(vec![5, 8])), &scalars, &["`a`", "dim=4"]);
    assert_refused(device, op, &with("h0", Tensor::zeros(vec![2, 4, 7])), &scalars, &["`h0`", "[2, 4, 8]"]);
    assert_refused(device, op, &with("dlast_state", Tensor::zeros(vec![2, 4])), &scalars, &["`dlast_state`", "rank 3"]);
    assert_refused(device, op, &with("u", Tensor::zeros(vec![2, 4, 0])), &scalars, &["`u`", "zero"]);
    assert_refused(device, op, &with("d_skip", Tensor::zeros(vec![4])), &scalars, &["`d_skip`", "not an input"]);
    assert_refused(device, op, &without("dout"), &scalars, &["`dout`", "missing"]);
    assert_refused(device, "selective_scan_fwd", &without("c"), &scalars, &["`c`", "missing"]);
    for bad in ["2", "yes", "-1"] {
        let scalars = scalars.clone().with("delta_softplus", bad);
        assert_refused(device, op, &inputs, &scalars, &["`delta_softplus`", "0 or 1"]);
    }
}

backend_tests!(forward_and_backward_match_reference, state_continuation, bitwise_deterministic, bad_input_is_refused);
