//! Mamba-3 preprocess forward and backward against the reference on every backend.

mod common;

use common::{assert_deterministic, assert_refused, check_against_reference, FORWARD, GRADIENT, PARAMETER_GRADIENT};
use mamba_kernels::ops::mamba3_preprocess::{example_inputs, force_branches, PreprocessShape};
use mamba_kernels::{Device, Tensor};

const CLAMP: Option<(f32, f32)> = Some((1e-3, 1e-1));

/// Every value of the matrix appears at least once: rows {1, 7, 256, 1000}, state
/// {16, 64, 128, 300}, bc_rows {1, 2, 8}, heads {1, 4, 32}, rope_angles {4, 16, 32}, inner {64, 200},
/// weights on and off, dt clamp (0, inf) and (1e-3, 1e-1); plus the realistic row width. The first rows of every case are
/// forced onto every branch of heavy_tail, its floor, softplus and its threshold.
fn cases() -> Vec<PreprocessShape> {
    let shape = |rows, inner, state, heads, bc_rows, rope_angles, norm_weights, dt_clamp| PreprocessShape {
        rows,
        inner,
        state,
        heads,
        bc_rows,
        rope_angles,
        norm_weights,
        dt_clamp,
    };
    vec![
        shape(1, 64, 16, 1, 1, 4, true, None),
        shape(7, 200, 64, 4, 2, 16, false, CLAMP),
        shape(256, 64, 128, 32, 8, 32, true, CLAMP),
        shape(1000, 200, 300, 4, 2, 16, true, None),
        shape(7, 64, 128, 32, 1, 32, false, None),
        shape(256, 200, 16, 1, 8, 4, true, CLAMP),
        // The realistic row (inner 1536): the batched float4 copy of dz and dx.
        shape(9, 1536, 128, 24, 1, 32, true, None),
    ]
}

fn tolerance(name: &str) -> f64 {
    match name {
        "bh" | "ch" | "dt" | "adt" => FORWARD,
        "ddt_bias" | "db_norm_weight" | "dc_norm_weight" => PARAMETER_GRADIENT,
        _ => GRADIENT,
    }
}

fn forward_and_backward_match_reference(device: &Device) {
    for (i, shape) in cases().iter().enumerate() {
        let case = format!("{shape:?}");
        for backward in [false, true] {
            let (mut inputs, scalars) = example_inputs(shape, backward, 100 + i as u64);
            force_branches(shape, &mut inputs);
            let op = if backward { "mamba3_preprocess_bwd" } else { "mamba3_preprocess_fwd" };
            check_against_reference(device, op, &inputs, &scalars, &tolerance, &case);
        }
    }
}

fn bitwise_deterministic(device: &Device) {
    let shape = &cases()[3];
    for (backward, op) in [(false, "mamba3_preprocess_fwd"), (true, "mamba3_preprocess_bwd")] {
        let (inputs, scalars) = example_inputs(shape, backward, 9);
        assert_deterministic(device, op, &inputs, &scalars, 5);
    }
}

fn bad_input_is_refused(device: &Device) {
    let shape = cases()[1].clone();
    let (inputs, scalars) = example_inputs(&shape, true, 3);
    let op = "mamba3_preprocess_bwd";
    let mut missing = inputs.clone();
    missing.remove("dangles");
    assert_refused(device, op, &missing, &scalars, &["`dangles`", "missing"]);
    let mut narrow = inputs.clone();
    narrow.insert("projected".into(), Tensor::zeros(vec![shape.rows, shape.width() - 1]));
    assert_refused(device, op, &narrow, &scalars, &["`projected`", "width"]);
    let mut bias = inputs.clone();
    bias.insert("dt_bias".into(), Tensor::zeros(vec![shape.heads + 1]));
    assert_refused(device, op, &bias, &scalars, &["`dt_bias`", "heads"]);
    let mut no_inner = scalars.clone();
    no_inner.remove("inner");
    assert_refused(device, op, &inputs, &no_inner, &["`inner`", "missing"]);
    assert_refused(device, op, &inputs, &scalars.clone().with("dt_min", "0.5").with("dt_max", "0.1"), &["`dt_max`"]);
    assert_refused(device, op, &inputs, &scalars.clone().with("heads", "0"), &["`heads`", "at least 1"]);
    assert_refused(device, op, &inputs, &scalars.clone().with("a_floor", "inf"), &["`a_floor`", "finite"]);
}

backend_tests!(forward_and_backward_match_reference, bitwise_deterministic, bad_input_is_refused);
