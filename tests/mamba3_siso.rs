//! Mamba-3 SISO scan forward and backward against the reference on every backend.

mod common;

use common::{check_against_reference, GRADIENT, PARAMETER_GRADIENT, SCAN_FORWARD};
use mamba_kernels::ops::mamba3_siso::{example_inputs, SisoShape};
use mamba_kernels::Device;

fn tolerance(name: &str) -> f64 {
    match name {
        "out" | "final_angle_state" | "final_ssm_state" | "final_k_state" | "final_v_state" => SCAN_FORWARD,
        "dq_bias" | "dk_bias" | "dd" => PARAMETER_GRADIENT,
        _ => GRADIENT,
    }
}

fn shape(
    batch: usize,
    length: usize,
    heads: usize,
    groups: usize,
    state: usize,
    head_dim: usize,
    rope: usize,
    chunk: usize,
) -> SisoShape {
    SisoShape {
        batch,
        length,
        heads,
        groups,
        state,
        head_dim,
        rope,
        chunk,
        d: true,
        z: true,
        states: true,
        final_grads: true,
    }
}

fn debug_small(device: &Device) {
    for (i, s) in [shape(1, 5, 1, 1, 8, 4, 2, 16), shape(2, 37, 4, 2, 16, 8, 4, 16), shape(1, 131, 2, 1, 32, 16, 8, 64)]
        .iter()
        .enumerate()
    {
        for backward in [false, true] {
            let (inputs, scalars) = example_inputs(s, backward, 10 + i as u64);
            let op = if backward { "mamba3_siso_bwd" } else { "mamba3_siso_fwd" };
            check_against_reference(device, op, &inputs, &scalars, &tolerance, &format!("{s:?}"));
        }
    }
}

backend_tests!(debug_small);
