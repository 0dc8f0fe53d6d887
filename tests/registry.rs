//! The kernel registry: every entry point of every Slang file has SPIR-V and a CUDA source, and is
//! reached by some registered op whose small example matches the reference on each backend.

mod common;

use std::collections::BTreeSet;

use mamba_kernels::gpu::{MatrixPath, StatePassing};
use mamba_kernels::kernels::KERNEL_FILES;
use mamba_kernels::ops::OPS;
use mamba_kernels::{BackendKind, Device};

#[test]
fn every_kernel_file_has_spirv_and_cuda_source() {
    assert!(!KERNEL_FILES.is_empty());
    for file in KERNEL_FILES {
        for entry in file.entry_points {
            assert!(
                entry.spirv.len() > 20 && entry.spirv.len() % 4 == 0,
                "{}::{}: SPIR-V missing",
                file.name,
                entry.name
            );
            assert_eq!(&entry.spirv[..4], &0x0723_0203u32.to_le_bytes(), "{}::{}: not SPIR-V", file.name, entry.name);
        }
        assert!(file.push_constant_bytes <= 128, "{}: push constants over 128 bytes", file.name);
        // Slang's generic ByteAddressBuffer Load<T>/Store<T> become memcpy (single-byte accesses) on
        // CUDA: kernels must go through shaders/common/storage.slang, which emits typed accesses.
        let Some(cuda_source) = file.cuda_source else { continue }; // `// targets: spirv`
        let kernel_code = cuda_source.split("SLANG_globalParams;").nth(1).unwrap_or("");
        for generic in [".Load<", ".Store(", ".Load(", ".LoadAligned<", ".StoreAligned("] {
            assert!(!kernel_code.contains(generic), "{}: CUDA code uses the generic `{generic}` accessor", file.name);
        }
        for entry in file.entry_points {
            let signature = format!("extern \"C\" __global__ void {}(", entry.name);
            assert!(cuda_source.contains(&signature), "{}: CUDA source lacks {}", file.name, signature);
        }
    }
}

#[test]
fn op_names_are_unique() {
    let names: BTreeSet<&str> = OPS.iter().map(|op| op.name()).collect();
    assert_eq!(names.len(), OPS.len());
}

/// Each registered op's small example against the reference, on every available GPU backend and
/// every matrix path it offers (each also with the fused SISO state kernels); and together the ops' dispatches reach every entry point of every
/// kernel file the backend compiles. The tensor-core entry points (SPIR-V-only files, names without
/// `emulated`) are exempt on a device without tensor cores: their emulated twins stand in for them.
fn every_entry_point_has_a_parity_case(device: &Device) {
    let Some(gpu) = device.gpu() else { return };
    let mut reached = BTreeSet::new();
    let paths = gpu.matrix_paths();
    // every matrix path, each once more with the fused SISO state kernels (the small examples
    // would otherwise take the split ones)
    let mut choices: Vec<(Device, String)> = Vec::new();
    for &path in &paths {
        let on_path = device.with_matrix_path(path).expect("the device offers this path");
        let fused = on_path.with_state_passing(StatePassing::Fused).expect("a GPU device");
        choices.push((on_path, path.name().to_string()));
        choices.push((fused, format!("{}, fused states", path.name())));
    }
    for (on_path, path_name) in &choices {
        let Some(path_gpu) = on_path.gpu() else { return };
        for op in OPS {
            for (inputs, scalars) in op.coverage_examples(3) {
                let prepared = op.prepare(path_gpu, &inputs, &scalars).unwrap_or_else(|e| panic!("{}: {e}", op.name()));
                for dispatch in &prepared.recorded.dispatches {
                    reached.insert(dispatch.kernel.label());
                }
                let check = |_: &str| common::PARAMETER_GRADIENT;
                let context = format!("coverage example, {path_name} path");
                common::check_against_reference(on_path, op.name(), &inputs, &scalars, &check, &context);
            }
        }
    }
    let cuda = device.kind() == BackendKind::Cuda;
    // The bandwidth ceiling's copy kernel: it must copy exactly.
    let values: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5 - 7.0).collect();
    let source = gpu.alloc(values.len()).expect("alloc");
    let target = gpu.alloc(values.len()).expect("alloc");
    gpu.upload(&source, &values).expect("upload");
    let copy = mamba_kernels::gpu::copy_dispatch(&source, &target).expect("copy dispatch");
    reached.insert(copy.kernel.label());
    gpu.run(&[copy]).expect("copy");
    assert_eq!(gpu.download(&target).expect("download"), values);
    for file in KERNEL_FILES {
        let spirv_only = file.cuda_source.is_none();
        if cuda && spirv_only {
            continue;
        }
        for (entry, _) in file.entry_points.iter().zip(0..) {
            // the SISO walks' loader-warp form is Vulkan's (mamba3_siso.rs, loader_walks)
            if cuda && entry.name.ends_with("_scan_ws") {
                continue;
            }
            let tensor_cores_only = spirv_only && !entry.name.contains("emulated");
            if tensor_cores_only && !paths.contains(&MatrixPath::TensorCores) {
                continue;
            }
            let label = format!("{}::{}", file.name, entry.name);
            assert!(reached.contains(&label), "no registered op dispatches {label}");
        }
    }
}

#[test]
fn vulkan_every_entry_point_has_a_parity_case() {
    if let Some(device) = common::device(BackendKind::Vulkan) {
        every_entry_point_has_a_parity_case(&device);
        common::assert_no_validation_messages(&device);
    }
}

#[test]
fn cuda_every_entry_point_has_a_parity_case() {
    if let Some(device) = common::device(BackendKind::Cuda) {
        every_entry_point_has_a_parity_case(&device);
    }
}

/// The workgroup memory counted from SPIR-V (what the Vulkan backend checks against the device's
/// limit) matches what the H200 reported: NVRTC's static shared memory for the SIMT chunk kernel,
/// NVIDIA Vulkan's pipeline statistics for the tile kernel (docs/PERFORMANCE.md, run 13); and every
/// kernel fits lavapipe's 32 KiB.
#[test]
fn workgroup_memory_is_counted_from_spirv() {
    let bytes = |file: &str, entry: &str| {
        KERNEL_FILES
            .iter()
            .find(|f| f.name == file)
            .and_then(|f| f.entry_points.iter().find(|e| e.name == entry))
            .map(|e| e.workgroup_memory_bytes())
            .unwrap_or_else(|| panic!("no entry point {file}::{entry}"))
    };
    assert_eq!(bytes("mamba3_siso_mma_state", "mamba3_siso_mma_chunk_state"), 26880);
    assert_eq!(bytes("mamba3_siso_mma_state", "mamba3_siso_mma_emulated_chunk_dstate"), 26880);
    assert_eq!(bytes("mamba3_siso_chunk", "mamba3_siso_chunk_fwd"), 23808);
    assert_eq!(bytes("copy", "copy_f32x4"), 0);
    for file in KERNEL_FILES {
        for entry in file.entry_points {
            let used = entry.workgroup_memory_bytes();
            assert!(used <= 32768, "{}::{}: {used} bytes of workgroup memory", file.name, entry.name);
        }
    }
}
