//! The small interface every GPU backend implements (allocate, upload, download, dispatch,
//! synchronise, time), and the dispatch description the ops build. Ops never see Vulkan or CUDA.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::kernels::{KernelRef, KERNEL_FILES};

/// Workgroups along x of a large 1-D grid; `shaders/common/grid.slang` must agree.
pub const GRID_X: u32 = 32768;

/// The largest push-constant block a kernel may use: the portable Vulkan minimum.
pub const MAX_PUSH_CONSTANT_BYTES: usize = 128;

/// The slot value that marks an optional tensor as absent (`NO_BUFFER` in storage.slang).
pub const NO_BUFFER: u32 = u32::MAX;

/// How the Mamba-3 SISO chunk kernels multiply matrices (every other op has one path).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatrixPath {
    /// f32 FMAs in register tiles on the shader cores: every backend and device.
    Simt,
    /// Split-bf16 MMAs on tensor cores (Vulkan cooperative matrices; shaders/common/tile_mma.slang).
    TensorCores,
    /// The tensor-core kernels with their MMAs emulated in f32 scalar code: any Vulkan device.
    /// Slower than `Simt`; it tests the tile kernels where there are no tensor cores.
    Emulated,
}

/// Set to `simt`, `tensor-cores` or `emulated` to choose the matrix path of a device (the default
/// is SIMT).
pub const MATRIX_PATH_ENV: &str = "MAMBA_MATRIX_PATH";

impl MatrixPath {
    pub const ALL: [MatrixPath; 3] = [MatrixPath::Simt, MatrixPath::TensorCores, MatrixPath::Emulated];

    pub fn name(self) -> &'static str {
        match self {
            MatrixPath::Simt => "simt",
            MatrixPath::TensorCores => "tensor-cores",
            MatrixPath::Emulated => "emulated",
        }
    }

    pub fn parse(text: &str) -> Result<Self> {
        MatrixPath::ALL.into_iter().find(|p| p.name() == text.trim()).ok_or_else(|| {
            Error::Dispatch(format!("{MATRIX_PATH_ENV}={text:?}: expected simt, tensor-cores or emulated"))
        })
    }

    /// The path a device that can take `available` takes: `MAMBA_MATRIX_PATH` when set (an error
    /// when the device cannot take it), else SIMT. Tensor cores are opt-in until their kernels beat
    /// the SIMT ones: on the H200 they do not yet (docs/PERFORMANCE.md, run 13).
    pub fn default_for(available: &[MatrixPath], device: &str) -> Result<Self> {
        if let Ok(text) = std::env::var(MATRIX_PATH_ENV) {
            let wanted = MatrixPath::parse(&text)?;
            return MatrixPath::check(wanted, available, device);
        }
        Ok(MatrixPath::Simt)
    }

    /// `wanted`, or an error naming what the device offers.
    pub fn check(wanted: MatrixPath, available: &[MatrixPath], device: &str) -> Result<Self> {
        if available.contains(&wanted) {
            return Ok(wanted);
        }
        let names: Vec<&str> = available.iter().map(|p| p.name()).collect();
        Err(Error::Dispatch(format!(
            "matrix path `{}` is not available on {device} (available: {})",
            wanted.name(),
            names.join(", ")
        )))
    }
}

/// How the Mamba-3 SISO scan carries states from chunk to chunk (on every matrix path).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatePassing {
    /// `Fused` where its B·H·tiles workgroups fill a GPU, else `Split`.
    Auto,
    /// One kernel per direction: a workgroup per (b, h, state tile) walks the chunks with the
    /// running state in registers, so the chunks' own states never go through memory.
    Fused,
    /// A workgroup per (b, h, chunk, state tile) for the chunks' own states, then an element-wise
    /// pass over the chunks: parallel over chunks as well, for small B·H.
    Split,
}

/// Set to `auto`, `fused` or `split` to choose how the SISO scan passes states (default `auto`).
pub const STATE_PASSING_ENV: &str = "MAMBA_SISO_STATE_PASSING";

impl StatePassing {
    pub const ALL: [StatePassing; 3] = [StatePassing::Auto, StatePassing::Fused, StatePassing::Split];

    pub fn name(self) -> &'static str {
        match self {
            StatePassing::Auto => "auto",
            StatePassing::Fused => "fused",
            StatePassing::Split => "split",
        }
    }

    pub fn parse(text: &str) -> Result<Self> {
        StatePassing::ALL
            .into_iter()
            .find(|p| p.name() == text.trim())
            .ok_or_else(|| Error::Dispatch(format!("{STATE_PASSING_ENV}={text:?}: expected auto, fused or split")))
    }

    /// `MAMBA_SISO_STATE_PASSING` when set (an error when it names no choice), else `Auto`.
    pub fn from_env() -> Result<Self> {
        match std::env::var(STATE_PASSING_ENV) {
            Ok(text) => StatePassing::parse(&text),
            Err(_) => Ok(StatePassing::Auto),
        }
    }
}

/// A GPU backend. Every method is synchronous from the caller's point of view.
pub trait Gpu: Send + Sync {
    /// `"vulkan"` or `"cuda"`.
    fn backend(&self) -> &'static str;
    /// The device in words (name, driver, API version).
    fn device_name(&self) -> String;
    /// Whether the device is a CPU implementation (lavapipe): benchmarks and demos size down.
    fn is_cpu(&self) -> bool {
        false
    }
    /// The largest buffer, in bytes, that kernels may address on this device.
    fn max_buffer_bytes(&self) -> u64;
    /// A buffer of `elements` f32 values; its contents are undefined until written.
    fn alloc(&self, elements: usize) -> Result<GpuBuffer>;
    fn upload(&self, buffer: &GpuBuffer, data: &[f32]) -> Result<()>;
    fn download(&self, buffer: &GpuBuffer) -> Result<Vec<f32>>;
    /// Runs the dispatches in order, each seeing every write of those before it, and waits.
    fn run(&self, dispatches: &[Dispatch]) -> Result<()>;
    /// Runs the dispatches `repeats` times in one submission; returns the GPU seconds of each repetition.
    fn time(&self, dispatches: &[Dispatch], repeats: usize) -> Result<Vec<f64>>;
    /// The matrix paths this device can take.
    fn matrix_paths(&self) -> Vec<MatrixPath> {
        vec![MatrixPath::Simt]
    }
    /// The matrix path the ops take on this device.
    fn matrix_path(&self) -> MatrixPath {
        MatrixPath::Simt
    }
    /// How the SISO scan passes states between chunks on this device.
    fn state_passing(&self) -> StatePassing {
        StatePassing::Auto
    }
}

/// Frees a buffer slot when its [`GpuBuffer`] is dropped.
pub(crate) trait SlotOwner: Send + Sync {
    fn release(&self, slot: u32);
}

/// A device buffer of f32 values. Kernels see it through its slot in the bindless buffer array.
pub struct GpuBuffer {
    slot: u32,
    elements: usize,
    owner: Arc<dyn SlotOwner>,
}

impl GpuBuffer {
    pub(crate) fn new(slot: u32, elements: usize, owner: Arc<dyn SlotOwner>) -> Self {
        GpuBuffer { slot, elements, owner }
    }

    /// The index kernels use to reach this buffer.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    pub fn elements(&self) -> usize {
        self.elements
    }

    pub fn bytes(&self) -> u64 {
        self.elements as u64 * 4
    }
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuffer(slot {}, {} f32)", self.slot, self.elements)
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        self.owner.release(self.slot);
    }
}

/// A `#[repr(C)]` push-constant block whose field list can be checked against Slang's reflection.
pub trait PushConstants: bytemuck::Pod {
    /// (field name, byte offset) in declaration order.
    const FIELDS: &'static [(&'static str, usize)];
}

/// Declares a push-constant struct: `#[repr(C)]`, `Pod`, and a field list for the reflection check.
#[macro_export]
macro_rules! push_constants {
    ($(#[$meta:meta])* $vis:vis struct $name:ident { $($(#[$fmeta:meta])* $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
        $vis struct $name { $($(#[$fmeta])* pub $field: $ty),* }
        impl $crate::gpu::PushConstants for $name {
            const FIELDS: &'static [(&'static str, usize)] =
                &[$((stringify!($field), ::core::mem::offset_of!($name, $field))),*];
        }
    };
}

/// Checks a push-constant struct against the reflected layout of a kernel file.
pub fn check_push_layout<P: PushConstants>(file: usize) -> Result<()> {
    let kernel = &KERNEL_FILES[file];
    let size = std::mem::size_of::<P>();
    if size != kernel.push_constant_bytes || P::FIELDS != kernel.push_constant_fields {
        return Err(Error::Dispatch(format!(
            "push constants of `{}`: Rust declares {} bytes {:?}, Slang reflects {} bytes {:?}",
            kernel.name,
            size,
            P::FIELDS,
            kernel.push_constant_bytes,
            kernel.push_constant_fields
        )));
    }
    Ok(())
}

/// One kernel launch: an entry point, a grid of workgroups and the push-constant bytes.
#[derive(Clone, Debug)]
pub struct Dispatch {
    pub kernel: KernelRef,
    pub groups: [u32; 3],
    push: [u8; MAX_PUSH_CONSTANT_BYTES],
    push_len: usize,
    /// Set by `alongside_previous`: no barrier between this dispatch and the one before it.
    overlaps_previous: bool,
}

impl Dispatch {
    /// A launch of `groups` workgroups. The push struct's size must match the kernel file's reflection.
    pub fn new<P: PushConstants>(kernel: KernelRef, groups: [u32; 3], push: &P) -> Result<Self> {
        let bytes = bytemuck::bytes_of(push);
        let file = kernel.file();
        if bytes.len() != file.push_constant_bytes || bytes.len() > MAX_PUSH_CONSTANT_BYTES {
            return Err(Error::Dispatch(format!(
                "{}: push constants are {} bytes, the kernel expects {}",
                kernel.label(),
                bytes.len(),
                file.push_constant_bytes
            )));
        }
        let mut data = [0u8; MAX_PUSH_CONSTANT_BYTES];
        data[..bytes.len()].copy_from_slice(bytes);
        Ok(Dispatch { kernel, groups, push: data, push_len: bytes.len(), overlaps_previous: false })
    }

    /// A 1-D grid of `workgroups` workgroups, laid out as (GRID_X, ceil(workgroups / GRID_X)); the
    /// kernel recovers the linear index with `linear_group` and skips indices past its work.
    pub fn linear<P: PushConstants>(kernel: KernelRef, workgroups: u64, push: &P) -> Result<Self> {
        let workgroups = workgroups.max(1);
        let x = workgroups.min(u64::from(GRID_X)) as u32;
        let y = workgroups.div_ceil(u64::from(GRID_X));
        if y > 65535 {
            return Err(Error::Dispatch(format!("{}: {workgroups} workgroups exceed the grid limit", kernel.label())));
        }
        Dispatch::new(kernel, [x, y as u32, 1], push)
    }

    /// Marks this dispatch as independent of the one recorded just before it: neither reads or
    /// writes what the other writes. A backend may then run the two at once (Vulkan records no
    /// barrier between them), which fills the GPU while a latency-bound pass runs. Both still come
    /// after everything recorded before the previous one. Results cannot depend on it: the two
    /// touch disjoint memory, and each one's reductions keep their fixed order.
    pub fn alongside_previous(mut self) -> Self {
        self.overlaps_previous = true;
        self
    }

    /// Whether `alongside_previous` marked it.
    pub fn overlaps_previous(&self) -> bool {
        self.overlaps_previous
    }

    /// The push-constant bytes.
    pub fn push_bytes(&self) -> &[u8] {
        &self.push[..self.push_len]
    }
}

crate::push_constants! {
    /// Push constants of `copy.slang`.
    pub struct CopyPush {
        source: u32,
        target: u32,
        vectors: u32,
        total_threads: u32,
    }
}
const _: () = assert!(std::mem::size_of::<CopyPush>() == crate::kernels::copy::PUSH_CONSTANT_BYTES);

/// The copy dispatch `copy_bandwidth` times: `elements` floats (a multiple of 4) from `source` to `target`.
pub fn copy_dispatch(source: &GpuBuffer, target: &GpuBuffer) -> Result<Dispatch> {
    let vectors = (source.elements().min(target.elements()) / 4) as u32;
    let groups = 132 * 16; // enough resident workgroups for any current GPU; grid-stride beyond that
    let push = CopyPush { source: source.slot(), target: target.slot(), vectors, total_threads: groups * 256 };
    Dispatch::new(crate::kernels::copy::COPY_F32X4, [groups, 1, 1], &push)
}

/// How long `warm_up` keeps the GPU busy. An idle H200 drops its SM clock to 345 MHz and needs
/// 0.1-0.3 s of load to return to 1980 MHz; measured cold, short Vulkan submissions ran 2-4x slow
/// (docs/PERFORMANCE.md, run 8). A training loop keeps the clock up, so benchmarks warm up first.
pub const WARM_UP_SECONDS: f64 = 0.3;

/// Runs `dispatches` back to back, untimed, until they have kept the GPU busy for
/// `WARM_UP_SECONDS` (in submissions of at most 1000 repetitions; at most 100 submissions, so a
/// device whose timestamps read zero cannot keep it looping).
pub fn warm_up(gpu: &dyn Gpu, dispatches: &[Dispatch]) -> Result<()> {
    let once = gpu.time(dispatches, 1)?.iter().sum::<f64>().max(1e-6);
    let mut busy = once;
    for _ in 0..100 {
        if busy >= WARM_UP_SECONDS {
            break;
        }
        let repeats = ((WARM_UP_SECONDS - busy) / once).ceil().clamp(1.0, 1000.0) as usize;
        busy += gpu.time(dispatches, repeats)?.iter().sum::<f64>().max(once);
    }
    Ok(())
}

/// Device-to-device copy bandwidth in bytes per second (read + written) through the shader cores:
/// the ceiling memory-bound ops are measured against. Median of `repeats` timed copies.
pub fn copy_bandwidth(gpu: &dyn Gpu, repeats: usize) -> Result<f64> {
    let bytes = if gpu.is_cpu() { 64u64 << 20 } else { 1u64 << 30 }.min(gpu.max_buffer_bytes() / 2);
    let elements = (bytes / 16 * 4) as usize;
    let source = gpu.alloc(elements)?;
    let target = gpu.alloc(elements)?;
    gpu.upload(&source, &vec![1.0f32; elements])?;
    let copy = [copy_dispatch(&source, &target)?];
    warm_up(gpu, &copy)?;
    let mut times = gpu.time(&copy, repeats.max(1))?;
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(2.0 * (elements * 4) as f64 / times[times.len() / 2])
}
