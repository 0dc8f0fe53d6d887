//! Every kernel file's Slang-emitted CUDA C++ (all but the SPIR-V-only files) compiles with NVRTC for Hopper and Ampere. NVRTC
//! loads without a GPU (make setup installs it from PyPI), so CI catches CUDA code generation
//! problems that only a GPU run would otherwise show.
#![cfg(feature = "cuda")]

use mamba_kernels::backend::cuda::compile::{compile_cubin, nvrtc_present};
use mamba_kernels::kernels::KERNEL_FILES;

/// Where to write every cubin (`NAME.ARCH.cubin`), for reading the machine code without a GPU:
/// `scripts/cuda-sass.sh` disassembles them with `nvdisasm`.
const CUBIN_DIR_ENV: &str = "MAMBA_CUBIN_DIR";

#[test]
fn every_kernel_file_compiles_with_nvrtc() {
    if !nvrtc_present() {
        eprintln!("skipped: NVRTC (libnvrtc.so) cannot be loaded; `make setup` installs it into .tools/nvrtc");
        return;
    }
    for arch in ["sm_90", "sm_80"] {
        for file in KERNEL_FILES.iter().filter(|f| f.cuda_source.is_some()) {
            match compile_cubin(file, arch) {
                Ok(cubin) => {
                    assert!(!cubin.is_empty(), "{}: empty cubin", file.name);
                    if let Some(dir) = std::env::var_os(CUBIN_DIR_ENV) {
                        let path = std::path::Path::new(&dir).join(format!("{}.{arch}.cubin", file.name));
                        std::fs::write(&path, &cubin).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    }
                }
                Err(error) => panic!("{error}"),
            }
        }
    }
}
