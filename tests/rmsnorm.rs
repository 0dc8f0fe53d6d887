//! RMSNorm forward and backward against the reference on every backend.

mod common;

use common::{assert_deterministic, assert_refused, check_against_reference, FORWARD, GRADIENT, PARAMETER_GRADIENT};
use mamba_kernels::ops::rmsnorm::example_inputs;
use mamba_kernels::{Device, Tensor};

/// Every value of the matrix appears: rows {1, 7, 256, 1000}; widths {16, 64, 128, 300}
/// plus widths past one lane stride (1536, 2048, 4099); widths that are and are not multiples of 4
/// (the float4 and scalar paths); weight on and off. The backward keeps rows of up to 1536 floats
/// (multiples of 4) in registers and reads longer ones twice: 1536 and 2048 sit either side.
const CASES: &[(usize, usize, bool)] = &[
    (1, 16, true),
    (7, 64, false),
    (256, 128, true),
    (1000, 300, true),
    (7, 1536, true),
    (5, 2048, true),
    (3, 4099, true),
    (9, 33, true),
    (1000, 16, false),
];

fn tolerance(name: &str) -> f64 {
    match name {
        "y" | "rstd" => FORWARD,
        "dweight" => PARAMETER_GRADIENT,
        _ => GRADIENT,
    }
}

fn forward_and_backward_match_reference(device: &Device) {
    for (i, &(rows, n, weight)) in CASES.iter().enumerate() {
        let case = format!("rows {rows} n {n} weight {weight}");
        let (inputs, scalars) = example_inputs(rows, n, weight, false, i as u64);
        check_against_reference(device, "rmsnorm_fwd", &inputs, &scalars, &tolerance, &case);
        let (inputs, scalars) = example_inputs(rows, n, weight, true, i as u64);
        check_against_reference(device, "rmsnorm_bwd", &inputs, &scalars, &tolerance, &case);
    }
}

fn bitwise_deterministic(device: &Device) {
    let (inputs, scalars) = example_inputs(1000, 300, true, true, 5);
    assert_deterministic(device, "rmsnorm_bwd", &inputs, &scalars, 5);
    let (inputs, scalars) = example_inputs(1000, 300, true, false, 5);
    assert_deterministic(device, "rmsnorm_fwd", &inputs, &scalars, 5);
}

fn bad_input_is_refused(device: &Device) {
    let (inputs, scalars) = example_inputs(4, 8, true, true, 1);
    let mut missing = inputs.clone();
    missing.remove("dy");
    assert_refused(device, "rmsnorm_bwd", &missing, &scalars, &["rmsnorm_bwd", "`dy`", "missing"]);
    let mut misshaped = inputs.clone();
    misshaped.insert("weight".into(), Tensor::zeros(vec![9]));
    assert_refused(device, "rmsnorm_bwd", &misshaped, &scalars, &["`weight`", "[8]", "[9]"]);
    let mut wrong_rank = inputs.clone();
    wrong_rank.insert("x".into(), Tensor::zeros(vec![32]));
    assert_refused(device, "rmsnorm_bwd", &wrong_rank, &scalars, &["`x`", "rank 2"]);
    let mut unknown = inputs.clone();
    unknown.insert("bias".into(), Tensor::zeros(vec![8]));
    assert_refused(device, "rmsnorm_bwd", &unknown, &scalars, &["`bias`", "not an input"]);
    let mut zero = inputs.clone();
    zero.insert("x".into(), Tensor::zeros(vec![0, 8]));
    assert_refused(device, "rmsnorm_fwd", &zero, &scalars, &["`x`", "zero"]);
    assert_refused(device, "rmsnorm_bwd", &inputs, &scalars.clone().with("eps", "nan"), &["`eps`", "finite"]);
    assert_refused(
        device,
        "rmsnorm_bwd",
        &inputs,
        &scalars.clone().with("epsilon", "1e-5"),
        &["`epsilon`", "not a scalar"],
    );
    assert_refused(device, "rmsnorm_bwd", &inputs, &scalars.clone().with("eps", "tiny"), &["`eps`", "number"]);
    assert_refused(device, "no_such_op", &inputs, &scalars, &["unknown op", "rmsnorm_fwd"]);
}

/// A tensor past 128 MiB (Vulkan's portable storage-buffer range, and lavapipe's) is computed
/// correctly where the device's buffer limit allows it, else refused with an error naming it:
/// never silently truncated.
fn oversized_tensor_is_refused_or_correct(device: &Device) {
    let Some(gpu) = device.gpu() else { return };
    let n = (1usize << 25) + 64;
    let must_refuse = (n as u64) * 4 > gpu.max_buffer_bytes();
    let x = Tensor::from_fn(vec![1, n], |i| ((i % 7) as f32) - 3.0);
    let mut inputs = mamba_kernels::TensorMap::new();
    inputs.insert("x".into(), x);
    let scalars = mamba_kernels::Scalars::new();
    match mamba_kernels::ops::run(device, "rmsnorm_fwd", &inputs, &scalars) {
        Err(error) => {
            let text = error.to_string();
            assert!(must_refuse, "refused a tensor within the device's limit: {text}");
            assert!(text.contains("`x`") && text.contains("bytes"), "unclear refusal: {text}");
        }
        Ok(outputs) => {
            assert!(!must_refuse, "accepted a tensor past the device's limit");
            let want = mamba_kernels::ops::run(&Device::cpu(), "rmsnorm_fwd", &inputs, &scalars).unwrap();
            assert!(mamba_kernels::testing::relative_error(&outputs["y"], &want["y"]) <= FORWARD);
        }
    }
}

backend_tests!(
    forward_and_backward_match_reference,
    bitwise_deterministic,
    bad_input_is_refused,
    oversized_tensor_is_refused_or_correct
);
