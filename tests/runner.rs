//! The runner (`examples/run.rs`) end to end: round trips through safetensors files, determinism
//! across processes, and refusals (one line, non-zero exit, no output file).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use mamba_kernels::ops::rmsnorm;
use mamba_kernels::{ops, BackendKind, Device, Tensor, TensorMap};
use safetensors::{Dtype, SafeTensors};

/// `target/<profile>/examples/run`, which `cargo test` builds beside the test binaries.
fn runner() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
    let path = profile_dir.join("examples").join(format!("run{}", std::env::consts::EXE_SUFFIX));
    assert!(path.is_file(), "runner not built at {} (cargo test builds examples)", path.display());
    path
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mamba-kernels-runner-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn write_inputs(path: &Path, tensors: &[(&str, Vec<usize>, Dtype, Vec<u8>)], metadata: &[(&str, &str)]) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, shape, dtype, bytes)| {
            (name.to_string(), safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).expect("view"))
        })
        .collect();
    let metadata: HashMap<String, String> = metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    safetensors::serialize_to_file(views, Some(metadata), path).expect("write inputs");
}

fn f32_bytes(t: &Tensor) -> Vec<u8> {
    t.data().iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn write_map(path: &Path, tensors: &TensorMap, metadata: &[(&str, &str)]) {
    let list: Vec<(&str, Vec<usize>, Dtype, Vec<u8>)> =
        tensors.iter().map(|(k, t)| (k.as_str(), t.shape().to_vec(), Dtype::F32, f32_bytes(t))).collect();
    write_inputs(path, &list, metadata);
}

fn read_outputs(path: &Path) -> (TensorMap, HashMap<String, String>) {
    let bytes = std::fs::read(path).expect("output file");
    let (_, metadata) = SafeTensors::read_metadata(&bytes).expect("header");
    let file = SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut map = TensorMap::new();
    for (name, view) in file.tensors() {
        assert_eq!(view.dtype(), Dtype::F32);
        let data = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        map.insert(name, Tensor::new(view.shape().to_vec(), data).expect("tensor"));
    }
    (map, metadata.metadata().clone().unwrap_or_default())
}

fn run(args: &[&str]) -> Output {
    Command::new(runner()).args(args).output().expect("runner starts")
}

fn op_args<'a>(op: &'a str, backend: &'a str, input: &'a Path, output: &'a Path) -> Vec<&'a str> {
    vec![
        "op",
        op,
        "--backend",
        backend,
        "--inputs",
        input.to_str().expect("utf-8"),
        "--output",
        output.to_str().expect("utf-8"),
    ]
}

fn round_trip_on(kind: BackendKind) {
    let Some(device) = common::device(kind) else { return };
    let dir = scratch_dir(&format!("round-trip-{kind}"));
    let (inputs, _) = rmsnorm::example_inputs(9, 40, true, true, 4);
    let input = dir.join("in.safetensors");
    write_map(&input, &inputs, &[("eps", "1e-6")]);
    let output = dir.join("out.safetensors");
    let result = run(&op_args("rmsnorm_bwd", kind.name(), &input, &output));
    assert!(result.status.success(), "runner failed: {}", String::from_utf8_lossy(&result.stderr));
    let (got, metadata) = read_outputs(&output);
    assert_eq!(metadata.get("backend").map(String::as_str), Some(kind.name()));
    assert_eq!(metadata.get("device"), Some(&device.description()));
    let want = ops::run(&device, "rmsnorm_bwd", &inputs, &mamba_kernels::Scalars::new().with("eps", "1e-6")).unwrap();
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (name, tensor) in &want {
        assert!(mamba_kernels::testing::bitwise_equal(tensor, &got[name]), "`{name}` differs from the library's");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cpu_round_trip_matches_library() {
    round_trip_on(BackendKind::Cpu);
}

#[test]
fn vulkan_round_trip_matches_library() {
    round_trip_on(BackendKind::Vulkan);
}

/// Two runner processes on the same inputs write bitwise-identical tensors.
#[test]
fn vulkan_two_processes_agree_bitwise() {
    if common::device(BackendKind::Vulkan).is_none() {
        return;
    }
    let dir = scratch_dir("two-processes");
    let shape = ops::mamba3_preprocess::PreprocessShape::for_size(ops::ExampleSize::Small);
    let (inputs, scalars) = ops::mamba3_preprocess::example_inputs(&shape, true, 8);
    let metadata: Vec<(&str, &str)> = scalars.iter().collect();
    let input = dir.join("in.safetensors");
    write_map(&input, &inputs, &metadata);
    let mut results = Vec::new();
    for i in 0..2 {
        let output = dir.join(format!("out{i}.safetensors"));
        let result = run(&op_args("mamba3_preprocess_bwd", "vulkan", &input, &output));
        assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
        results.push(read_outputs(&output).0);
    }
    for (name, tensor) in &results[0] {
        assert!(mamba_kernels::testing::bitwise_equal(tensor, &results[1][name]), "`{name}` differs across processes");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Refusal: a non-zero exit, one line on stderr that names the problem, and no output file.
fn assert_refusal(args: &[&str], output: &Path, needles: &[&str]) {
    let result = run(args);
    let stderr = String::from_utf8_lossy(&result.stderr).to_string();
    assert!(!result.status.success(), "runner accepted bad input: {args:?}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "not one line: {stderr:?}");
    for needle in needles {
        assert!(stderr.contains(needle), "stderr {stderr:?} does not mention {needle:?}");
    }
    assert!(!output.exists(), "output file left behind after a refusal");
    let leftovers: Vec<_> = std::fs::read_dir(output.parent().expect("dir"))
        .expect("dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind");
}

fn refusals_on(kind: BackendKind) {
    if common::device(kind).is_none() {
        return;
    }
    let dir = scratch_dir(&format!("refusals-{kind}"));
    let backend = kind.name();
    let output = dir.join("out.safetensors");
    let (inputs, _) = rmsnorm::example_inputs(3, 8, true, true, 2);
    let x = f32_bytes(&inputs["x"]);
    let dy = f32_bytes(&inputs["dy"]);

    let missing = dir.join("missing.safetensors");
    write_inputs(&missing, &[("x", vec![3, 8], Dtype::F32, x.clone())], &[]);
    assert_refusal(&op_args("rmsnorm_bwd", backend, &missing, &output), &output, &["`dy`", "missing"]);

    let misshaped = dir.join("misshaped.safetensors");
    write_inputs(
        &misshaped,
        &[("x", vec![3, 8], Dtype::F32, x.clone()), ("dy", vec![4, 6], Dtype::F32, dy.clone())],
        &[],
    );
    assert_refusal(&op_args("rmsnorm_bwd", backend, &misshaped, &output), &output, &["`dy`", "[3, 8]", "[4, 6]"]);

    let mistyped = dir.join("mistyped.safetensors");
    let half = vec![0u8; 3 * 8 * 2];
    write_inputs(&mistyped, &[("x", vec![3, 8], Dtype::F32, x.clone()), ("dy", vec![3, 8], Dtype::F16, half)], &[]);
    assert_refusal(&op_args("rmsnorm_bwd", backend, &mistyped, &output), &output, &["`dy`", "F16", "F32"]);

    let shape = ops::mamba3_preprocess::PreprocessShape::for_size(ops::ExampleSize::Small);
    let (pre_inputs, pre_scalars) = ops::mamba3_preprocess::example_inputs(&shape, false, 1);
    let no_state: Vec<(&str, &str)> = pre_scalars.iter().filter(|(k, _)| *k != "state").collect();
    let no_scalar = dir.join("no-scalar.safetensors");
    write_map(&no_scalar, &pre_inputs, &no_state);
    assert_refusal(&op_args("mamba3_preprocess_fwd", backend, &no_scalar, &output), &output, &["`state`", "missing"]);

    let bad_scalar = dir.join("bad-scalar.safetensors");
    write_inputs(&bad_scalar, &[("x", vec![3, 8], Dtype::F32, x.clone())], &[("eps", "abc")]);
    assert_refusal(&op_args("rmsnorm_fwd", backend, &bad_scalar, &output), &output, &["`eps`"]);

    let not_a_file = dir.join("garbage.safetensors");
    std::fs::write(&not_a_file, b"not a safetensors file").expect("write");
    assert_refusal(&op_args("rmsnorm_fwd", backend, &not_a_file, &output), &output, &["safetensors"]);

    assert_refusal(&op_args("no_such_op", backend, &missing, &output), &output, &["unknown op", "rmsnorm_fwd"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cpu_refusals_are_one_line_and_leave_no_file() {
    refusals_on(BackendKind::Cpu);
}

#[test]
fn vulkan_refusals_are_one_line_and_leave_no_file() {
    refusals_on(BackendKind::Vulkan);
}

#[test]
fn devices_lists_every_backend() {
    let result = run(&["devices"]);
    assert!(result.status.success());
    let stdout = String::from_utf8_lossy(&result.stdout);
    for backend in ["cpu:", "vulkan:", "cuda:"] {
        assert!(stdout.contains(backend), "`devices` output lacks {backend}: {stdout}");
    }
    let _ = Device::cpu();
}
