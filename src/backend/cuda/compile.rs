//! NVRTC compilation of the Slang-emitted CUDA C++, with explicit options (the device's own
//! architecture, no fast math), cached in memory per (kernel file, architecture) and on disk under
//! the user's cache directory, keyed by a hash of the source, the options and the driver and NVRTC
//! versions.

use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::sys as nvrtc;

use crate::error::{Error, Result};
use crate::kernels::KernelFile;

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library was found by is_culib_present(); out-pointers are valid.
    let status = unsafe { nvrtc::nvrtcVersion(&mut major, &mut minor) };
    if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::DeviceUnavailable { backend: "cuda", reason: format!("nvrtcVersion failed: {status:?}") });
    }
    Ok((major, minor))
}

/// The options every kernel file is compiled with: the device's architecture, IEEE division and
/// square root, no flushing of denormals, no fast math (it breaks gradient flow through long
/// recurrences), contraction into FMA allowed (fixed per compile, so still deterministic).
pub fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=true".into(),
    ]
}

/// Occupancy targets, `__launch_bounds__(threads, blocks)` on these entry points: NVRTC gave them
/// more registers than `blocks` workgroups per SM leave (147-183 for the SISO chunk kernels, one
/// block per SM; 104 for the conv1d backward, two), where NVIDIA's Vulkan compiler keeps the same
/// kernels at 128 and 64 registers. Measured in docs/PERFORMANCE.md, runs 13 and 19
/// (`chunk_fwd`: 156 registers, 2527 µs; capped, 128 and 24 B of stack, 1881 µs).
const MIN_BLOCKS: &[(&str, &str, u32)] = &[
    ("mamba3_siso_state", "mamba3_siso_chunk_state", 2),
    ("mamba3_siso_state", "mamba3_siso_chunk_dstate", 2),
    ("mamba3_siso_state", "mamba3_siso_state_scan", 2),
    ("mamba3_siso_state", "mamba3_siso_dstate_scan", 2),
    ("mamba3_siso_chunk", "mamba3_siso_chunk_fwd", 2),
    ("mamba3_siso_chunk", "mamba3_siso_chunk_bwd", 2),
    ("mamba3_siso_chunk", "mamba3_siso_chunk_fwd_save", 2),
    ("mamba3_siso_chunk", "mamba3_siso_chunk_bwd_saved", 2),
    ("mamba3_siso_dqk", "mamba3_siso_dqk", 2),
    ("causal_conv1d", "causal_conv1d_bwd_upto4", 4),
    ("rmsnorm", "rmsnorm_bwd_resident", 2),
];

/// Overrides the occupancy targets for tuning: `entry=N,entry=N` (N = 0 removes an entry's).
pub const MIN_BLOCKS_ENV: &str = "MAMBA_CUDA_MIN_BLOCKS";

fn min_blocks(file: &str, entry: &str) -> Option<u32> {
    if let Ok(text) = std::env::var(MIN_BLOCKS_ENV) {
        let named = text.split(',').filter_map(|item| item.split_once('=')).find(|(name, _)| name.trim() == entry);
        if let Some((_, value)) = named {
            return value.trim().parse::<u32>().ok().filter(|&blocks| blocks > 0);
        }
    }
    MIN_BLOCKS.iter().find(|(f, e, _)| *f == file && *e == entry).map(|&(_, _, blocks)| blocks)
}

/// The CUDA C++ NVRTC compiles: Slang's, with the occupancy targets written into the signatures.
fn launch_source(file: &KernelFile) -> Result<String> {
    let mut source = cuda_source(file)?.to_string();
    for entry in file.entry_points {
        if let Some(blocks) = min_blocks(file.name, entry.name) {
            let threads: u32 = entry.threads.iter().product();
            let signature = format!("extern \"C\" __global__ void {}(", entry.name);
            let bounded =
                format!("extern \"C\" __global__ void __launch_bounds__({threads}, {blocks}) {}(", entry.name);
            source = source.replacen(&signature, &bounded, 1);
        }
    }
    Ok(source)
}

fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for byte in part.iter() {
            hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
        }
        hash = (hash ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// The disk cache's key for a cubin: its source, options and the driver and NVRTC versions.
fn disk_key(source: &str, options: &[String], driver_version: i32) -> Result<u64> {
    let (major, minor) = nvrtc_version()?;
    let versions = format!("driver {driver_version} nvrtc {major}.{minor}");
    Ok(fnv64(&[source.as_bytes(), options.join(" ").as_bytes(), versions.as_bytes()]))
}

fn disk_path(file: &KernelFile, key: u64) -> Option<PathBuf> {
    crate::backend::cache_dir().map(|dir| dir.join("cuda").join(format!("{}-{key:016x}.cubin", file.name)))
}

type MemoryCache = Mutex<HashMap<(usize, String), Arc<Vec<u8>>>>;

fn memory_cache() -> &'static MemoryCache {
    static CACHE: OnceLock<MemoryCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Where a cubin came from (for the cold/warm start measurement).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Memory,
    Disk,
    Compiled,
}

/// The cubin of kernel file `index` for `arch`: from memory, else from disk, else compiled.
pub fn cubin(index: usize, file: &KernelFile, arch: &str, driver_version: i32) -> Result<(Arc<Vec<u8>>, Origin)> {
    let key = (index, arch.to_string());
    if let Some(found) = memory_cache().lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok((found.clone(), Origin::Memory));
    }
    let source = launch_source(file)?;
    let options = options(arch);
    let path = disk_path(file, disk_key(&source, &options, driver_version)?);
    let (bytes, origin) = match path.as_ref().and_then(|p| std::fs::read(p).ok()).filter(|b| looks_like_elf(b)) {
        Some(bytes) => (bytes, Origin::Disk),
        None => {
            let bytes = compile(file, &source, &options)?;
            if let Some(path) = &path {
                store(path, &bytes);
            }
            (bytes, Origin::Compiled)
        }
    };
    let bytes = Arc::new(bytes);
    memory_cache().lock().unwrap_or_else(|p| p.into_inner()).insert(key, bytes.clone());
    Ok((bytes, origin))
}

/// The CUDA C++ of a kernel file; an error for a SPIR-V-only file.
fn cuda_source(file: &KernelFile) -> Result<&'static str> {
    file.cuda_source.ok_or_else(|| {
        Error::Dispatch(format!("kernel file `{}` is compiled for Vulkan only (`// targets: spirv`)", file.name))
    })
}

/// Compiles one kernel file for `arch` without a device or caches: the check CI runs wherever
/// NVRTC loads, so that CUDA code generation problems show up without a GPU, and the cubins
/// whose machine code (registers, spills, SASS through `nvdisasm`) can be read on such a machine.
pub fn compile_cubin(file: &KernelFile, arch: &str) -> Result<Vec<u8>> {
    compile(file, &launch_source(file)?, &options(arch))
}

/// Whether NVRTC can be loaded on this machine.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { nvrtc::is_culib_present() }
}

/// Forgets a cubin that failed to load, in memory and on disk, so that the next call recompiles.
pub fn forget(index: usize, file: &KernelFile, arch: &str, driver_version: i32) {
    memory_cache().lock().unwrap_or_else(|p| p.into_inner()).remove(&(index, arch.to_string()));
    if let Ok(source) = launch_source(file) {
        let key = disk_key(&source, &options(arch), driver_version);
        if let Some(path) = key.ok().and_then(|key| disk_path(file, key)) {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn looks_like_elf(bytes: &[u8]) -> bool {
    bytes.len() > 64 && bytes[..4] == [0x7f, b'E', b'L', b'F']
}

/// Atomic write (temporary file + rename); failures are ignored, the cache is an optimisation.
fn store(path: &PathBuf, bytes: &[u8]) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let temporary = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&temporary, bytes).is_ok() && std::fs::rename(&temporary, path).is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
}

fn nvrtc_failure(file: &KernelFile, options: &[String], log: String) -> Error {
    Error::Nvrtc { kernel: file.name.to_string(), options: options.to_vec(), log }
}

/// Compiles one kernel file's (launch) source to a cubin.
fn compile(file: &KernelFile, source: &str, options: &[String]) -> Result<Vec<u8>> {
    let source = CString::new(source).map_err(|_| nvrtc_failure(file, options, "source has a NUL".into()))?;
    let name =
        CString::new(format!("{}.cu", file.name)).map_err(|_| nvrtc_failure(file, options, "bad name".into()))?;
    let option_strings: Vec<CString> = options.iter().filter_map(|o| CString::new(o.as_str()).ok()).collect();
    let option_pointers: Vec<*const c_char> = option_strings.iter().map(|o| o.as_ptr()).collect();
    let mut program: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NVRTC calls with valid, NUL-terminated strings that outlive the program.
    unsafe {
        let status = nvrtc::nvrtcCreateProgram(
            &mut program,
            source.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            return Err(nvrtc_failure(file, options, format!("nvrtcCreateProgram: {}", error_text(status))));
        }
        let status = nvrtc::nvrtcCompileProgram(program, option_pointers.len() as i32, option_pointers.as_ptr());
        let log = program_log(program);
        if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            nvrtc::nvrtcDestroyProgram(&mut program);
            return Err(nvrtc_failure(file, options, format!("{}: {log}", error_text(status))));
        }
        let mut size = 0usize;
        let status = nvrtc::nvrtcGetCUBINSize(program, &mut size);
        if status != nvrtc::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            nvrtc::nvrtcDestroyProgram(&mut program);
            return Err(nvrtc_failure(
                file,
                options,
                format!("no cubin ({}); is --gpu-architecture a real sm_XY?", error_text(status)),
            ));
        }
        let mut cubin = vec![0u8; size];
        let status = nvrtc::nvrtcGetCUBIN(program, cubin.as_mut_ptr() as *mut c_char);
        nvrtc::nvrtcDestroyProgram(&mut program);
        if status != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            return Err(nvrtc_failure(file, options, format!("nvrtcGetCUBIN: {}", error_text(status))));
        }
        Ok(cubin)
    }
}

unsafe fn error_text(status: nvrtc::nvrtcResult) -> String {
    let text = nvrtc::nvrtcGetErrorString(status);
    if text.is_null() {
        format!("{status:?}")
    } else {
        CStr::from_ptr(text).to_string_lossy().into_owned()
    }
}

unsafe fn program_log(program: nvrtc::nvrtcProgram) -> String {
    let mut size = 0usize;
    if nvrtc::nvrtcGetProgramLogSize(program, &mut size) != nvrtc::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return String::new();
    }
    let mut log = vec![0u8; size];
    if nvrtc::nvrtcGetProgramLog(program, log.as_mut_ptr() as *mut c_char) != nvrtc::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    String::from_utf8_lossy(&log).trim_end_matches('\0').trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::KERNEL_FILES;

    /// Every occupancy target names an entry point that exists, and lands in its signature (a
    /// rename would otherwise drop it silently).
    #[test]
    fn occupancy_targets_reach_their_signatures() {
        for &(file_name, entry_name, blocks) in MIN_BLOCKS {
            let file = KERNEL_FILES.iter().find(|f| f.name == file_name).expect("kernel file of a target");
            let entry = file.entry_points.iter().find(|e| e.name == entry_name).expect("entry point of a target");
            let threads: u32 = entry.threads.iter().product();
            let source = launch_source(file).expect("CUDA source");
            let bounded = format!("__global__ void __launch_bounds__({threads}, {blocks}) {entry_name}(");
            assert!(source.contains(&bounded), "{file_name}: no `{bounded}`");
        }
    }
}
