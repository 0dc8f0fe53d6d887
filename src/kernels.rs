//! The registry of compiled kernels. `build.rs` compiles every file under `shaders/kernels/` and
//! generates the table below: one [`KernelFile`] per Slang file, one [`KernelRef`] constant per
//! entry point (for example `kernels::rmsnorm::RMSNORM_FWD`).

/// One compiled Slang kernel file.
#[derive(Debug)]
pub struct KernelFile {
    /// File stem, e.g. `rmsnorm`.
    pub name: &'static str,
    /// Self-contained CUDA C++ emitted by `slangc -target cuda`; `None` for a SPIR-V-only file
    /// (first line `// targets: spirv`).
    pub cuda_source: Option<&'static str>,
    /// Size of the push-constant block, from reflection.
    pub push_constant_bytes: usize,
    /// Push-constant fields and byte offsets, from reflection.
    pub push_constant_fields: &'static [(&'static str, usize)],
    pub entry_points: &'static [EntryPoint],
}

/// One compute entry point of a kernel file.
#[derive(Debug)]
pub struct EntryPoint {
    pub name: &'static str,
    /// Thread-group size declared by `[numthreads]`.
    pub threads: [u32; 3],
    /// SPIR-V 1.5 module holding this entry point alone.
    pub spirv: &'static [u8],
}

/// A handle to one entry point: indices into [`KERNEL_FILES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelRef {
    pub file: usize,
    pub entry: usize,
}

impl KernelRef {
    pub fn file(&self) -> &'static KernelFile {
        &KERNEL_FILES[self.file]
    }

    pub fn entry_point(&self) -> &'static EntryPoint {
        &KERNEL_FILES[self.file].entry_points[self.entry]
    }

    /// `file::entry`, for messages.
    pub fn label(&self) -> String {
        format!("{}::{}", self.file().name, self.entry_point().name)
    }
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
