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

impl EntryPoint {
    /// The SPIR-V as 32-bit words (what `vkCreateShaderModule` takes).
    pub fn spirv_words(&self) -> Vec<u32> {
        self.spirv.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// Bytes of workgroup (shared) memory the entry point declares: the sizes of the module's
    /// `Workgroup` variables, counted from the SPIR-V (each module holds one entry point). A device
    /// that allows less must refuse the kernel up front: NVIDIA's Vulkan driver loses the device
    /// instead (docs/PERFORMANCE.md, run 13).
    pub fn workgroup_memory_bytes(&self) -> u64 {
        workgroup_memory_bytes(&self.spirv_words())
    }
}

/// Sums the sizes of the `Workgroup` variables of a SPIR-V module (natural alignment, no padding
/// beyond it). Types it does not know count as 0.
pub(crate) fn workgroup_memory_bytes(words: &[u32]) -> u64 {
    const OP_TYPE_BOOL: u32 = 20;
    const OP_TYPE_INT: u32 = 21;
    const OP_TYPE_FLOAT: u32 = 22;
    const OP_TYPE_VECTOR: u32 = 23;
    const OP_TYPE_MATRIX: u32 = 24;
    const OP_TYPE_ARRAY: u32 = 28;
    const OP_TYPE_STRUCT: u32 = 30;
    const OP_TYPE_POINTER: u32 = 32;
    const OP_CONSTANT: u32 = 43;
    const OP_VARIABLE: u32 = 59;
    const WORKGROUP: u32 = 4;
    use std::collections::HashMap;

    // (size, alignment) per type id; constant values; pointee type per pointer type id
    let mut types: HashMap<u32, (u64, u64)> = HashMap::new();
    let mut constants: HashMap<u32, u64> = HashMap::new();
    let mut pointees: HashMap<u32, u32> = HashMap::new();
    let mut total = 0u64;
    let mut at = 5; // after the header
    while at < words.len() {
        let count = (words[at] >> 16) as usize;
        let opcode = words[at] & 0xffff;
        if count == 0 || at + count > words.len() {
            break;
        }
        let operands = &words[at + 1..at + count];
        let size_of = |id: u32| types.get(&id).copied().unwrap_or((0, 1));
        match (opcode, operands) {
            (OP_TYPE_BOOL, [id, ..]) => {
                types.insert(*id, (4, 4));
            }
            (OP_TYPE_INT | OP_TYPE_FLOAT, [id, width, ..]) => {
                let bytes = u64::from(*width / 8).max(1);
                types.insert(*id, (bytes, bytes));
            }
            (OP_TYPE_VECTOR | OP_TYPE_MATRIX, [id, component, n, ..]) => {
                let (size, align) = size_of(*component);
                types.insert(*id, (size * u64::from(*n), align));
            }
            (OP_TYPE_ARRAY, [id, element, length, ..]) => {
                let (size, align) = size_of(*element);
                let n = constants.get(length).copied().unwrap_or(0);
                types.insert(*id, (size.next_multiple_of(align) * n, align));
            }
            (OP_TYPE_STRUCT, [id, members @ ..]) => {
                let (mut size, mut align) = (0u64, 1u64);
                for member in members {
                    let (member_size, member_align) = size_of(*member);
                    size = size.next_multiple_of(member_align) + member_size;
                    align = align.max(member_align);
                }
                types.insert(*id, (size.next_multiple_of(align), align));
            }
            (OP_TYPE_POINTER, [id, _class, pointee, ..]) => {
                pointees.insert(*id, *pointee);
            }
            (OP_CONSTANT, [_type, id, value, ..]) => {
                constants.insert(*id, u64::from(*value));
            }
            (OP_VARIABLE, [pointer_type, _id, WORKGROUP, ..]) => {
                let pointee = pointees.get(pointer_type).copied().unwrap_or(0);
                total += size_of(pointee).0;
            }
            _ => {}
        }
        at += count;
    }
    total
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
