//! Causal conv1d forward and backward against the reference on every backend.

mod common;

use common::{assert_deterministic, assert_refused, check_against_reference, FORWARD, GRADIENT, PARAMETER_GRADIENT};
use mamba_kernels::ops::causal_conv1d::{example_inputs, ConvShape};
use mamba_kernels::testing::relative_error;
use mamba_kernels::{ops, Device, Scalars, Tensor, TensorMap};

#[allow(clippy::too_many_arguments)]
fn shape(
    batch: usize,
    dim: usize,
    length: usize,
    width: usize,
    bias: bool,
    silu: bool,
    initial_states: bool,
    dfinal_states: bool,
) -> ConvShape {
    ConvShape { batch, dim, length, width, bias, silu, initial_states, dfinal_states }
}

/// Every value of the matrix appears at least once: B {1, 3}, D {8, 64, 72}, W {2, 3, 4, 5, 8},
/// L {1, 2, 3, 7, 8, 9, 129, 1025}, bias, SiLU, initial_states and dfinal_states each on and off.
/// L < W − 1 (final states reaching into the initial states) appears for W 4, 5 and 8. The last
/// cases go past the matrix to reach the other work splits: long aligned rows, where whole batches
/// of quads take the float4 path, for both kernel windows (W ≤ 4 and W ≤ 8, narrower widths
/// padded), partial batches (2 quads per lane), several segments per row (whose gradient partials
/// add over segments and batch), and a long row with a ragged tail.
fn cases() -> Vec<ConvShape> {
    vec![
        shape(1, 8, 1, 4, true, true, true, true),
        shape(3, 8, 2, 5, false, true, true, true),
        shape(1, 72, 3, 8, true, false, true, false),
        shape(3, 64, 7, 2, false, false, false, true),
        shape(1, 8, 8, 3, true, true, false, false),
        shape(3, 72, 9, 8, true, true, true, true),
        shape(1, 64, 129, 4, false, true, true, true),
        shape(3, 8, 129, 3, true, false, false, false),
        shape(3, 64, 1025, 5, true, true, false, true),
        shape(1, 72, 1025, 8, false, false, true, true),
        shape(3, 8, 8192, 4, true, true, true, true),
        shape(1, 8, 9001, 7, true, true, true, true),
        shape(3, 8, 4096, 8, true, true, true, true),
        shape(1, 64, 2048, 2, false, true, false, true),
        shape(3, 8, 1024, 5, true, false, true, false),
        shape(1, 8, 4096, 6, false, false, false, false),
    ]
}

fn tolerance(name: &str) -> f64 {
    match name {
        "out" | "final_states" => FORWARD,
        "dweight" | "dbias" => PARAMETER_GRADIENT,
        _ => GRADIENT,
    }
}

fn forward_and_backward_match_reference(device: &Device) {
    for (i, case) in cases().iter().enumerate() {
        let label = format!("{case:?}");
        let (inputs, scalars) = example_inputs(case, false, 200 + i as u64);
        check_against_reference(device, "causal_conv1d_fwd", &inputs, &scalars, &tolerance, &label);
        let (inputs, scalars) = example_inputs(case, true, 200 + i as u64);
        let got = check_against_reference(device, "causal_conv1d_bwd", &inputs, &scalars, &tolerance, &label);
        assert_eq!(got.contains_key("dbias"), case.bias, "{label}: dbias present iff bias given");
        assert_eq!(got.contains_key("dinitial_states"), case.initial_states, "{label}: dinitial_states presence");
    }
}

/// Time steps [start, end) of a [B, D, L] tensor.
fn time_slice(tensor: &Tensor, start: usize, end: usize) -> Tensor {
    let (rows, length) = (tensor.shape()[0] * tensor.shape()[1], tensor.shape()[2]);
    let data: Vec<f32> =
        (0..rows).flat_map(|r| tensor.data()[r * length + start..r * length + end].iter().copied()).collect();
    Tensor::new(vec![tensor.shape()[0], tensor.shape()[1], end - start], data).expect("slice size")
}

/// Two [B, D, ·] tensors joined along time.
fn time_concat(a: &Tensor, b: &Tensor) -> Tensor {
    let rows = a.shape()[0] * a.shape()[1];
    let (la, lb) = (a.shape()[2], b.shape()[2]);
    let data: Vec<f32> = (0..rows)
        .flat_map(|r| a.data()[r * la..(r + 1) * la].iter().chain(&b.data()[r * lb..(r + 1) * lb]).copied())
        .collect();
    Tensor::new(vec![a.shape()[0], a.shape()[1], la + lb], data).expect("concat size")
}

fn sum(a: &Tensor, b: &Tensor) -> Tensor {
    Tensor::new(a.shape().to_vec(), a.data().iter().zip(b.data()).map(|(x, y)| x + y).collect()).expect("same shape")
}

fn run(device: &Device, op: &str, inputs: &TensorMap, scalars: &Scalars, label: &str) -> TensorMap {
    ops::run(device, op, inputs, scalars).unwrap_or_else(|e| panic!("{op} [{label}] on {}: {e}", device.kind()))
}

fn assert_close(got: &Tensor, want: &Tensor, limit: f64, what: &str) {
    let error = relative_error(got, want);
    assert!(error <= limit, "{what}: error {error:.3e} > {limit:.1e}");
}

/// Two calls with the state carried give one call: forward (final states of the first half are the
/// initial states of the second) and backward (the second half's dinitial_states is the first
/// half's dfinal_states; the parameter gradients add). The first split is shorter than W − 1.
fn state_continuation(device: &Device) {
    for (case, split) in
        [(shape(3, 8, 9, 5, true, true, true, true), 2), (shape(1, 64, 129, 4, true, true, true, true), 64)]
    {
        let label = format!("{case:?} split at {split}");
        let length = case.length;
        let (inputs, scalars) = example_inputs(&case, true, 77);
        let whole_fwd = {
            let mut fwd = inputs.clone();
            fwd.remove("dout");
            fwd.remove("dfinal_states");
            run(device, "causal_conv1d_fwd", &fwd, &scalars, &label)
        };
        let whole_bwd = run(device, "causal_conv1d_bwd", &inputs, &scalars, &label);

        let half = |start: usize, end: usize, initial: Tensor| {
            let mut part = TensorMap::new();
            part.insert("x".to_string(), time_slice(&inputs["x"], start, end));
            part.insert("weight".to_string(), inputs["weight"].clone());
            part.insert("bias".to_string(), inputs["bias"].clone());
            part.insert("initial_states".to_string(), initial);
            part
        };
        let first = half(0, split, inputs["initial_states"].clone());
        let first_fwd = run(device, "causal_conv1d_fwd", &first, &scalars, &label);
        let second = half(split, length, first_fwd["final_states"].clone());
        let second_fwd = run(device, "causal_conv1d_fwd", &second, &scalars, &label);
        assert_close(&time_concat(&first_fwd["out"], &second_fwd["out"]), &whole_fwd["out"], FORWARD, &label);
        assert_close(&second_fwd["final_states"], &whole_fwd["final_states"], FORWARD, &label);

        let mut second_bwd_in = second.clone();
        second_bwd_in.insert("dout".to_string(), time_slice(&inputs["dout"], split, length));
        second_bwd_in.insert("dfinal_states".to_string(), inputs["dfinal_states"].clone());
        let second_bwd = run(device, "causal_conv1d_bwd", &second_bwd_in, &scalars, &label);
        let mut first_bwd_in = first.clone();
        first_bwd_in.insert("dout".to_string(), time_slice(&inputs["dout"], 0, split));
        first_bwd_in.insert("dfinal_states".to_string(), second_bwd["dinitial_states"].clone());
        let first_bwd = run(device, "causal_conv1d_bwd", &first_bwd_in, &scalars, &label);
        assert_close(&time_concat(&first_bwd["dx"], &second_bwd["dx"]), &whole_bwd["dx"], GRADIENT, &label);
        assert_close(&first_bwd["dinitial_states"], &whole_bwd["dinitial_states"], GRADIENT, &label);
        for name in ["dweight", "dbias"] {
            let total = sum(&first_bwd[name], &second_bwd[name]);
            assert_close(&total, &whole_bwd[name], PARAMETER_GRADIENT, &format!("{label}: {name}"));
        }
    }
}

fn bitwise_deterministic(device: &Device) {
    let case = &cases()[10];
    for (backward, op) in [(false, "causal_conv1d_fwd"), (true, "causal_conv1d_bwd")] {
        let (inputs, scalars) = example_inputs(case, backward, 9);
        assert_deterministic(device, op, &inputs, &scalars, 5);
    }
}

fn bad_input_is_refused(device: &Device) {
    let case = shape(2, 8, 9, 4, true, true, true, true);
    let (inputs, scalars) = example_inputs(&case, true, 3);
    let op = "causal_conv1d_bwd";
    for width in [1, 9] {
        let mut bad = inputs.clone();
        bad.insert("weight".into(), Tensor::zeros(vec![8, width]));
        bad.insert("initial_states".into(), Tensor::zeros(vec![2, 8, width.saturating_sub(1)]));
        assert_refused(device, op, &bad, &scalars, &["`weight`", &format!("W = {width}"), "2 ≤ W ≤ 8"]);
        assert_refused(device, "causal_conv1d_fwd", &bad, &Scalars::new(), &["`weight`", "out of range"]);
    }
    let mut channels = inputs.clone();
    channels.insert("weight".into(), Tensor::zeros(vec![7, 4]));
    assert_refused(device, op, &channels, &scalars, &["`weight`", "D=8"]);
    let mut bias = inputs.clone();
    bias.insert("bias".into(), Tensor::zeros(vec![9]));
    assert_refused(device, op, &bias, &scalars, &["`bias`", "[8]", "[9]"]);
    let mut dout = inputs.clone();
    dout.insert("dout".into(), Tensor::zeros(vec![2, 8, 10]));
    assert_refused(device, op, &dout, &scalars, &["`dout`", "L=9", "[2, 8, 10]"]);
    let mut missing = inputs.clone();
    missing.remove("dout");
    assert_refused(device, op, &missing, &scalars, &["`dout`", "missing"]);
    let mut initial = inputs.clone();
    initial.insert("initial_states".into(), Tensor::zeros(vec![2, 8, 4]));
    assert_refused(device, op, &initial, &scalars, &["`initial_states`", "W-1=3", "[2, 8, 4]"]);
    let mut dfinal = inputs.clone();
    dfinal.insert("dfinal_states".into(), Tensor::zeros(vec![2, 8, 2]));
    assert_refused(device, op, &dfinal, &scalars, &["`dfinal_states`", "W-1=3"]);
    let mut rank = inputs.clone();
    rank.insert("x".into(), Tensor::zeros(vec![16, 9]));
    assert_refused(device, op, &rank, &scalars, &["`x`", "rank 3"]);
    let mut unknown = inputs.clone();
    unknown.insert("seq_idx".into(), Tensor::zeros(vec![2, 9]));
    assert_refused(device, op, &unknown, &scalars, &["`seq_idx`", "not an input"]);
    for silu in ["2", "yes", "-1"] {
        assert_refused(device, op, &inputs, &Scalars::new().with("silu", silu), &["`silu`", "0 or 1"]);
    }
    assert_refused(device, op, &inputs, &Scalars::new().with("activation", "silu"), &["`activation`", "not a scalar"]);
}

backend_tests!(forward_and_backward_match_reference, state_continuation, bitwise_deterministic, bad_input_is_refused);
