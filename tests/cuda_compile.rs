//! Every kernel file's Slang-emitted CUDA C++ (all but the SPIR-V-only files) compiles with NVRTC for Hopper and Ampere. NVRTC
//! loads without a GPU (make setup installs it from PyPI), so CI catches CUDA code generation
//! problems that only a GPU run would otherwise show.
#![cfg(feature = "cuda")]

use mamba_kernels::backend::cuda::compile::{check_compiles, nvrtc_present};
use mamba_kernels::kernels::KERNEL_FILES;

#[test]
fn every_kernel_file_compiles_with_nvrtc() {
    if !nvrtc_present() {
        eprintln!("skipped: NVRTC (libnvrtc.so) cannot be loaded; `make setup` installs it into .tools/nvrtc");
        return;
    }
    for arch in ["sm_90", "sm_80"] {
        for file in KERNEL_FILES.iter().filter(|f| f.cuda_source.is_some()) {
            match check_compiles(file, arch) {
                Ok(bytes) => assert!(bytes > 0, "{}: empty cubin", file.name),
                Err(error) => panic!("{error}"),
            }
        }
    }
}
