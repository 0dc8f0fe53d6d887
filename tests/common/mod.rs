//! The parity-suite harness: shared devices, the per-backend test macro, reference comparison,
//! determinism and refusal checks. Every test file includes it with `mod common;`.
#![allow(dead_code)]

use std::sync::OnceLock;

use mamba_kernels::gpu::{MatrixPath, StatePassing};
use mamba_kernels::testing::{bitwise_equal, relative_error};
use mamba_kernels::{ops, BackendKind, Device, Scalars, TensorMap};

/// Set by CI: a missing Vulkan device fails the suite instead of skipping it.
pub const REQUIRE_VULKAN_ENV: &str = "MAMBA_REQUIRE_VULKAN";

static VULKAN: OnceLock<Result<Device, String>> = OnceLock::new();
static CUDA: OnceLock<Result<Device, String>> = OnceLock::new();

/// The backend's shared device, or `None` (with the reason printed) when it is absent.
pub fn device(kind: BackendKind) -> Option<Device> {
    let cell = match kind {
        BackendKind::Cpu => return Some(Device::cpu()),
        BackendKind::Vulkan => &VULKAN,
        BackendKind::Cuda => &CUDA,
    };
    match cell.get_or_init(|| Device::open(kind).map_err(|e| e.to_string())) {
        Ok(device) => Some(device.clone()),
        Err(reason) => {
            if kind == BackendKind::Vulkan && std::env::var(REQUIRE_VULKAN_ENV).is_ok_and(|v| v == "1") {
                panic!("{REQUIRE_VULKAN_ENV}=1 but the Vulkan backend is unavailable: {reason}");
            }
            eprintln!("skipped: {reason}");
            None
        }
    }
}

static VULKAN_TILES: OnceLock<Option<Device>> = OnceLock::new();

/// The Vulkan device taking the matrix-tile kernels: on tensor cores where it has them, else
/// emulated (lavapipe), so that those kernels run in CI as well. `None` when Vulkan is absent.
pub fn vulkan_tiles_device() -> Option<Device> {
    VULKAN_TILES
        .get_or_init(|| {
            let device = device(BackendKind::Vulkan)?;
            let gpu = device.gpu()?;
            let path = if gpu.matrix_paths().contains(&MatrixPath::TensorCores) {
                MatrixPath::TensorCores
            } else {
                MatrixPath::Emulated
            };
            eprintln!("matrix-tile kernels on {}: {}", gpu.device_name(), path.name());
            Some(device.with_matrix_path(path).expect("a Vulkan device takes the tile kernels"))
        })
        .clone()
}

/// Fails if the validation layer (when on) reported anything.
pub fn assert_no_validation_messages(device: &Device) {
    if let Some(vulkan) = device.vulkan_backend() {
        let messages = vulkan.validation_messages();
        assert!(messages.is_empty(), "{} validation message(s), first: {}", messages.len(), messages[0]);
    }
}

/// Instantiates each listed `fn(&Device)` once per backend: `cpu::name`, `vulkan::name`, `cuda::name`.
/// An absent backend skips with a printed reason (Vulkan fails instead under MAMBA_REQUIRE_VULKAN=1).
#[macro_export]
macro_rules! backend_tests {
    ($($name:ident),* $(,)?) => {
        mod cpu {
            $(#[test] fn $name() {
                let device = super::common::device(mamba_kernels::BackendKind::Cpu).expect("cpu");
                super::$name(&device);
            })*
        }
        mod vulkan {
            $(#[test] fn $name() {
                if let Some(device) = super::common::device(mamba_kernels::BackendKind::Vulkan) {
                    super::$name(&device);
                    super::common::assert_no_validation_messages(&device);
                }
            })*
        }
        mod cuda {
            $(#[test] fn $name() {
                if let Some(device) = super::common::device(mamba_kernels::BackendKind::Cuda) {
                    super::$name(&device);
                }
            })*
        }
    };
}

/// As `backend_tests!` for the ops with a matrix-tile path (Mamba-3 SISO): `vulkan_tiles::name`
/// runs each test on `vulkan_tiles_device()`.
#[macro_export]
macro_rules! tile_path_tests {
    ($($name:ident),* $(,)?) => {
        mod vulkan_tiles {
            $(#[test] fn $name() {
                if let Some(device) = super::common::vulkan_tiles_device() {
                    super::$name(&device);
                    super::common::assert_no_validation_messages(&device);
                }
            })*
        }
    };
}

/// `device` passing SISO scan states as `passing` says (`Device::with_state_passing`).
pub fn with_state_passing(device: &Device, passing: StatePassing) -> Device {
    device.with_state_passing(passing).expect("a GPU device takes either state passing")
}

/// As `backend_tests!` for the SISO scan's two ways of passing states: `vulkan_fused_states::name`,
/// `cuda_fused_states::name` and `vulkan_tiles_fused_states::name` (the fused walks on matrix
/// tiles) run each test with the fused state kernels whatever the shape (the small shapes of the
/// suite would otherwise take the split ones).
#[macro_export]
macro_rules! state_passing_tests {
    ($($name:ident),* $(,)?) => {
        mod vulkan_fused_states {
            $(#[test] fn $name() {
                if let Some(device) = super::common::device(mamba_kernels::BackendKind::Vulkan) {
                    let fused = super::common::with_state_passing(&device, mamba_kernels::gpu::StatePassing::Fused);
                    super::$name(&fused);
                    super::common::assert_no_validation_messages(&device);
                }
            })*
        }
        mod cuda_fused_states {
            $(#[test] fn $name() {
                if let Some(device) = super::common::device(mamba_kernels::BackendKind::Cuda) {
                    super::$name(&super::common::with_state_passing(&device, mamba_kernels::gpu::StatePassing::Fused));
                }
            })*
        }
        mod vulkan_tiles_fused_states {
            $(#[test] fn $name() {
                if let Some(device) = super::common::vulkan_tiles_device() {
                    let fused = super::common::with_state_passing(&device, mamba_kernels::gpu::StatePassing::Fused);
                    super::$name(&fused);
                    super::common::assert_no_validation_messages(&device);
                }
            })*
        }
    };
}

/// Tolerances of spec/ops.md.
pub const FORWARD: f64 = 1e-5;
pub const SCAN_FORWARD: f64 = 2e-5;
pub const GRADIENT: f64 = 1e-4;
pub const PARAMETER_GRADIENT: f64 = 3e-4;

/// Runs `op` on `device` and on the CPU reference; every output must be present on both and
/// within `tolerance(output name)`. Returns the device outputs.
pub fn check_against_reference(
    device: &Device,
    op: &str,
    inputs: &TensorMap,
    scalars: &Scalars,
    tolerance: &dyn Fn(&str) -> f64,
    case: &str,
) -> TensorMap {
    let got =
        ops::run(device, op, inputs, scalars).unwrap_or_else(|e| panic!("{op} [{case}] on {}: {e}", device.kind()));
    let want = ops::run(&Device::cpu(), op, inputs, scalars).unwrap_or_else(|e| panic!("{op} [{case}] reference: {e}"));
    let got_names: Vec<&String> = got.keys().collect();
    let want_names: Vec<&String> = want.keys().collect();
    assert_eq!(got_names, want_names, "{op} [{case}]: outputs differ");
    for (name, reference) in &want {
        let error = relative_error(&got[name], reference);
        let limit = tolerance(name);
        assert!(
            error <= limit,
            "{op} [{case}] on {}: output `{name}` {:?} error {error:.3e} > {limit:.1e}",
            device.kind(),
            reference.shape()
        );
    }
    got
}

/// Runs `op` `runs` times; every output must be bitwise identical to the first run's.
pub fn assert_deterministic(device: &Device, op: &str, inputs: &TensorMap, scalars: &Scalars, runs: usize) {
    let first = ops::run(device, op, inputs, scalars).unwrap_or_else(|e| panic!("{op}: {e}"));
    for run in 1..runs {
        let again = ops::run(device, op, inputs, scalars).unwrap_or_else(|e| panic!("{op}: {e}"));
        for (name, tensor) in &first {
            assert!(bitwise_equal(tensor, &again[name]), "{op} on {}: `{name}` differs in run {run}", device.kind());
        }
    }
}

/// The op must refuse the input with an error whose message contains every one of `needles`.
pub fn assert_refused(device: &Device, op: &str, inputs: &TensorMap, scalars: &Scalars, needles: &[&str]) {
    match ops::run(device, op, inputs, scalars) {
        Ok(_) => panic!("{op} accepted input that should be refused (expected an error mentioning {needles:?})"),
        Err(error) => {
            let text = error.to_string();
            for needle in needles {
                assert!(text.contains(needle), "{op}: error {text:?} does not mention {needle:?}");
            }
        }
    }
}
