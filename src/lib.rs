//! Deterministic forward and backward GPU kernels for Mamba state-space layers.
//!
//! Kernels are written once in Slang (`shaders/`) and compiled by `build.rs` to SPIR-V for the
//! Vulkan backend and to CUDA C++ for the CUDA backend. Every op also has an f64 CPU reference,
//! which is the specification the GPU backends are tested against. No kernel uses floating-point
//! atomics: every reduction has an order fixed by the shapes alone, so results are bitwise
//! identical from run to run.
//!
//! ```no_run
//! use mamba_kernels::{ops, BackendKind, Device};
//! let device = Device::open(BackendKind::Vulkan)?;
//! let (inputs, scalars) = ops::rmsnorm::example_inputs(4, 64, true, false, 1);
//! let outputs = ops::run(&device, "rmsnorm_fwd", &inputs, &scalars)?;
//! println!("{:?}", outputs["y"].shape());
//! # Ok::<(), mamba_kernels::Error>(())
//! ```

pub mod backend;
pub mod error;
pub mod gpu;
pub mod kernels;
pub mod ops;
pub mod random;
pub mod tensor;
pub mod testing;

pub use backend::{BackendKind, Device};
pub use error::{Error, Result};
pub use tensor::{Scalars, Tensor, TensorMap};
