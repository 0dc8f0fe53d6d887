//! The persisted Vulkan pipeline cache: written after first use, and a corrupt or truncated file
//! is ignored and rewritten, never an error. Runs alone in its own process because it points
//! MAMBA_CACHE_DIR at a scratch directory.

mod common;

use mamba_kernels::backend::vulkan::pipeline_cache;
use mamba_kernels::{ops, BackendKind, Device};

fn run_once(device: &Device) {
    let (inputs, scalars) = ops::rmsnorm::example_inputs(5, 33, true, false, 1);
    let got = ops::run(device, "rmsnorm_fwd", &inputs, &scalars).expect("rmsnorm on Vulkan");
    let want = ops::run(&Device::cpu(), "rmsnorm_fwd", &inputs, &scalars).expect("reference");
    assert!(mamba_kernels::testing::relative_error(&got["y"], &want["y"]) <= common::FORWARD);
}

#[test]
fn corrupt_and_truncated_cache_files_are_rebuilt() {
    let dir = std::env::temp_dir().join(format!("mamba-kernels-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var("MAMBA_CACHE_DIR", &dir);
    if common::device(BackendKind::Vulkan).is_none() {
        return;
    }
    let open = || Device::open(BackendKind::Vulkan).expect("vulkan device");

    let device = open();
    run_once(&device);
    let path = device.vulkan_backend().and_then(|v| v.pipeline_cache_path()).expect("a cache path");
    assert!(path.starts_with(&dir), "cache path {} not under MAMBA_CACHE_DIR", path.display());
    drop(device);
    let valid = std::fs::read(&path).expect("cache written after first use");
    assert!(valid.len() > 64);

    // Flip bytes in the blob: the checksum no longer matches.
    let mut corrupt = valid.clone();
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0x5a;
    corrupt[70] ^= 0xff;
    std::fs::write(&path, &corrupt).expect("write corrupt cache");
    let device = open();
    run_once(&device);
    common::assert_no_validation_messages(&device);
    drop(device);
    let rewritten = std::fs::read(&path).expect("cache rewritten");
    assert_ne!(rewritten, corrupt, "corrupt cache was not replaced");

    // Truncate inside the header, then inside the blob.
    for keep in [10usize, valid.len() / 2] {
        std::fs::write(&path, &valid[..keep]).expect("write truncated cache");
        let device = open();
        run_once(&device);
        common::assert_no_validation_messages(&device);
        drop(device);
        let rewritten = std::fs::read(&path).expect("cache rewritten");
        assert!(rewritten.len() > keep, "truncated cache ({keep} bytes) was not rebuilt");
    }

    // Garbage of the right size with a valid-looking start is also rejected by the header check.
    let mut garbage = vec![0u8; valid.len()];
    garbage[..8].copy_from_slice(b"MKVKPC01");
    std::fs::write(&path, &garbage).expect("write garbage");
    let device = open();
    run_once(&device);
    drop(device);
    assert_ne!(std::fs::read(&path).expect("cache"), garbage);
    let _ = pipeline_cache::cache_dir();
    let _ = std::fs::remove_dir_all(&dir);
}
