//! Backends: the f64 CPU reference, Vulkan, and (with the `cuda` feature) CUDA. A [`Device`] is
//! what callers hold; ops ask it for its GPU, or run the reference when it has none.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::{Dispatch, Gpu, GpuBuffer, MatrixPath, StatePassing};

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "vulkan")]
pub mod vulkan;

/// Where compiled pipelines and kernels are kept between runs: `$MAMBA_CACHE_DIR`, else the
/// user's cache directory joined with `mamba-kernels`.
pub fn cache_dir() -> Option<std::path::PathBuf> {
    if let Some(dir) = std::env::var_os("MAMBA_CACHE_DIR") {
        return Some(std::path::PathBuf::from(dir));
    }
    dirs::cache_dir().map(|d| d.join("mamba-kernels"))
}

/// Which backend runs an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The f64 reference (the specification).
    Cpu,
    Vulkan,
    Cuda,
}

impl BackendKind {
    pub const ALL: [BackendKind; 3] = [BackendKind::Cpu, BackendKind::Vulkan, BackendKind::Cuda];

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Vulkan => "vulkan",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendKind {
    type Err = Error;
    fn from_str(text: &str) -> Result<Self> {
        match text {
            "cpu" => Ok(BackendKind::Cpu),
            "vulkan" => Ok(BackendKind::Vulkan),
            "cuda" => Ok(BackendKind::Cuda),
            other => Err(Error::DeviceUnavailable {
                backend: "unknown",
                reason: format!("unknown backend {other:?}; expected cpu, vulkan or cuda"),
            }),
        }
    }
}

/// An opened backend.
#[derive(Clone)]
pub struct Device {
    kind: BackendKind,
    gpu: Option<Arc<dyn Gpu>>,
    #[cfg(feature = "vulkan")]
    vulkan: Option<Arc<vulkan::VulkanGpu>>,
}

impl Device {
    /// The f64 CPU reference.
    pub fn cpu() -> Self {
        Device {
            kind: BackendKind::Cpu,
            gpu: None,
            #[cfg(feature = "vulkan")]
            vulkan: None,
        }
    }

    /// Opens a backend: for Vulkan the device `MAMBA_VK_DEVICE` names or the best one found.
    /// `MAMBA_SISO_STATE_PASSING`, when set, chooses how the SISO scan passes states.
    pub fn open(kind: BackendKind) -> Result<Self> {
        let device = match kind {
            BackendKind::Cpu => return Ok(Device::cpu()),
            BackendKind::Vulkan => Self::vulkan()?,
            BackendKind::Cuda => Self::cuda()?,
        };
        match StatePassing::from_env()? {
            StatePassing::Auto => Ok(device),
            chosen => device.with_state_passing(chosen),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda() -> Result<Self> {
        let gpu = Arc::new(cuda::CudaGpu::new()?);
        Ok(Device {
            kind: BackendKind::Cuda,
            gpu: Some(gpu as Arc<dyn Gpu>),
            #[cfg(feature = "vulkan")]
            vulkan: None,
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda() -> Result<Self> {
        Err(Error::DeviceUnavailable {
            backend: "cuda",
            reason: "this build has no CUDA backend (build with `--features cuda`)".into(),
        })
    }

    #[cfg(feature = "vulkan")]
    fn vulkan() -> Result<Self> {
        let gpu = Arc::new(vulkan::VulkanGpu::new()?);
        Ok(Device { kind: BackendKind::Vulkan, gpu: Some(gpu.clone() as Arc<dyn Gpu>), vulkan: Some(gpu) })
    }

    #[cfg(not(feature = "vulkan"))]
    fn vulkan() -> Result<Self> {
        Err(Error::DeviceUnavailable { backend: "vulkan", reason: "this build has no Vulkan backend".into() })
    }

    pub fn kind(&self) -> BackendKind {
        self.kind
    }

    /// The GPU behind this device; `None` for the CPU reference.
    pub fn gpu(&self) -> Option<&dyn Gpu> {
        self.gpu.as_deref()
    }

    /// The Vulkan backend itself, for its extras (validation messages, pipeline-cache path).
    #[cfg(feature = "vulkan")]
    pub fn vulkan_backend(&self) -> Option<&vulkan::VulkanGpu> {
        self.vulkan.as_deref()
    }

    /// The same device taking matrix path `path` (an error if it cannot): tests and benchmarks
    /// compare the paths on one device.
    pub fn with_matrix_path(&self, path: MatrixPath) -> Result<Device> {
        let gpu = self.gpu_for_choice("matrix paths")?;
        MatrixPath::check(path, &gpu.matrix_paths(), &gpu.device_name())?;
        Ok(self.with_choices(Choices { inner: gpu.clone(), path, state_passing: gpu.state_passing() }))
    }

    /// The same device passing SISO scan states as `passing` says: tests run both ways on one
    /// device whatever the shape, benchmarks compare them.
    pub fn with_state_passing(&self, passing: StatePassing) -> Result<Device> {
        let gpu = self.gpu_for_choice("state passing")?;
        Ok(self.with_choices(Choices { inner: gpu.clone(), path: gpu.matrix_path(), state_passing: passing }))
    }

    fn gpu_for_choice(&self, what: &str) -> Result<&Arc<dyn Gpu>> {
        self.gpu.as_ref().ok_or_else(|| Error::DeviceUnavailable {
            backend: "cpu",
            reason: format!("the CPU reference has no {what} to choose"),
        })
    }

    fn with_choices(&self, choices: Choices) -> Device {
        let mut device = self.clone();
        device.gpu = Some(Arc::new(choices) as Arc<dyn Gpu>);
        device
    }

    /// The device in words.
    pub fn description(&self) -> String {
        match &self.gpu {
            None => "CPU reference (f64)".to_string(),
            Some(gpu) => gpu.device_name(),
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({}: {})", self.kind, self.description())
    }
}

/// A device with another matrix path or state passing: every call goes to the device itself.
struct Choices {
    inner: Arc<dyn Gpu>,
    path: MatrixPath,
    state_passing: StatePassing,
}

impl Gpu for Choices {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn is_cpu(&self) -> bool {
        self.inner.is_cpu()
    }
    fn max_buffer_bytes(&self) -> u64 {
        self.inner.max_buffer_bytes()
    }
    fn alloc(&self, elements: usize) -> Result<GpuBuffer> {
        self.inner.alloc(elements)
    }
    fn upload(&self, buffer: &GpuBuffer, data: &[f32]) -> Result<()> {
        self.inner.upload(buffer, data)
    }
    fn download(&self, buffer: &GpuBuffer) -> Result<Vec<f32>> {
        self.inner.download(buffer)
    }
    fn run(&self, dispatches: &[Dispatch]) -> Result<()> {
        self.inner.run(dispatches)
    }
    fn time(&self, dispatches: &[Dispatch], repeats: usize) -> Result<Vec<f64>> {
        self.inner.time(dispatches, repeats)
    }
    fn matrix_paths(&self) -> Vec<MatrixPath> {
        self.inner.matrix_paths()
    }
    fn matrix_path(&self) -> MatrixPath {
        self.path
    }
    fn state_passing(&self) -> StatePassing {
        self.state_passing
    }
}
