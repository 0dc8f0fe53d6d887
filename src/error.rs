//! The one error type of the crate. Every variant names what was wrong, where, and what was
//! expected, so that the runner can print it as a one-line reason.

use std::path::PathBuf;

/// Everything that can go wrong in the library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An op name that is not in the registry.
    #[error("unknown op `{name}`; known ops: {known}")]
    UnknownOp { name: String, known: String },

    /// A tensor that is missing, unexpected, or of the wrong rank, shape or dtype.
    #[error("{op}: tensor `{tensor}`: {problem}")]
    Tensor { op: String, tensor: String, problem: String },

    /// A scalar that is missing, unparsable, unknown or out of range.
    #[error("{op}: scalar `{scalar}`: {problem}")]
    Scalar { op: String, scalar: String, problem: String },

    /// A valid request this build or device cannot serve.
    #[error("{op}: unsupported: {reason}")]
    Unsupported { op: String, reason: String },

    /// A tensor larger than one storage buffer of the device may be (or than 32-bit indexing reaches).
    #[error(
        "{op}: tensor `{tensor}` needs {bytes} bytes, more than the {limit} bytes one buffer may hold on {device}"
    )]
    TooLarge { op: String, tensor: String, bytes: u64, limit: u64, device: String },

    /// A kernel that declares more workgroup (shared) memory than the device allows.
    #[error("kernel {kernel} needs {bytes} bytes of workgroup memory, more than the {limit} bytes {device} allows")]
    WorkgroupMemory { kernel: String, bytes: u64, limit: u64, device: String },

    /// The backend cannot be used on this machine.
    #[error("{backend} backend unavailable: {reason}")]
    DeviceUnavailable { backend: &'static str, reason: String },

    /// A Vulkan call returned an error.
    #[error("Vulkan call {call} failed: {result}")]
    Vulkan { call: &'static str, result: String },

    /// Device memory could not be allocated.
    #[error("allocating {bytes} bytes of device memory failed: {reason}")]
    Allocation { bytes: u64, reason: String },

    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {reason}")]
    CudaDriver { call: &'static str, reason: String },

    /// NVRTC could not compile a kernel file.
    #[error("NVRTC failed to compile kernel file `{kernel}` with options {options:?}:\n{log}")]
    Nvrtc { kernel: String, options: Vec<String>, log: String },

    /// The on-disk pipeline cache could not be written (reading problems only cause a rebuild).
    #[error("pipeline cache {path}: {reason}")]
    PipelineCache { path: PathBuf, reason: String },

    /// A dispatch asked for a kernel or buffer the backend does not know.
    #[error("invalid dispatch: {0}")]
    Dispatch(String),
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn tensor(op: &str, tensor: &str, problem: impl Into<String>) -> Self {
        Error::Tensor { op: op.to_string(), tensor: tensor.to_string(), problem: problem.into() }
    }

    pub(crate) fn scalar(op: &str, scalar: &str, problem: impl Into<String>) -> Self {
        Error::Scalar { op: op.to_string(), scalar: scalar.to_string(), problem: problem.into() }
    }

    pub(crate) fn unsupported(op: &str, reason: impl Into<String>) -> Self {
        Error::Unsupported { op: op.to_string(), reason: reason.into() }
    }
}
