//! The headless runner: any op from and to `.safetensors` files, the device list, benchmarks, and
//! the `make run` demo.
//!
//! ```text
//! run op <OP> --backend <cpu|vulkan|cuda> --inputs IN.safetensors --output OUT.safetensors
//! run devices
//! run bench [--backend vulkan] [--ops a,b] [--repeats N]
//! run demo [--backend vulkan]
//! run ops
//! ```
//! Scalars travel in the safetensors header's `__metadata__`. Every refusal is one line on stderr
//! and a non-zero exit; no output file is left behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand};
use mamba_kernels::gpu::{Dispatch, Gpu};
use mamba_kernels::ops::{self, ExampleSize};
use mamba_kernels::testing::{bitwise_equal, relative_error};
use mamba_kernels::{BackendKind, Device, Scalars, Tensor, TensorMap};
use safetensors::{Dtype, SafeTensors};

#[derive(Parser)]
#[command(name = "run", about = "Run mamba-kernels ops headlessly", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one op on one backend, from and to safetensors files.
    Op {
        /// Op name, as in spec/ops.md (see `run ops`).
        op: String,
        #[arg(long, default_value = "vulkan")]
        backend: String,
        #[arg(long)]
        inputs: PathBuf,
        #[arg(long)]
        output: PathBuf,
    },
    /// List backends and devices, with the reason for any that is absent.
    Devices,
    /// List the ops.
    Ops,
    /// Time ops on a GPU backend at the sizes the issues name, against the copy bandwidth.
    Bench {
        #[arg(long, default_value = "vulkan")]
        backend: String,
        /// Comma-separated op names; all ops when absent.
        #[arg(long)]
        ops: Option<String>,
        /// Timed repetitions per op (after one warm-up).
        #[arg(long, default_value_t = 20)]
        repeats: usize,
        /// Use the small CPU-device sizes even on a GPU.
        #[arg(long)]
        small: bool,
        /// Also time every dispatch of each op on its own (after one full run fills the buffers).
        #[arg(long)]
        detail: bool,
        /// Overrides a scalar of the benchmark examples, e.g. `--scalar chunk_size=32`
        /// (repeatable; applied to every selected op, validated by it).
        #[arg(long = "scalar", value_name = "NAME=VALUE")]
        scalars: Vec<String>,
        /// Times the Mamba-3 SISO scan as a training step runs it: the forward also returns the
        /// chunk states and y before the gate (`save_for_backward`), which the backward then reads
        /// instead of recomputing them.
        #[arg(long)]
        save_for_backward: bool,
    },
    /// Runs every op's example on several backends and prints the largest difference between
    /// them and against the CPU reference, per output.
    Compare {
        /// Comma-separated GPU backends.
        #[arg(long, default_value = "vulkan,cuda")]
        backends: String,
        /// Use the benchmark sizes (`gpu`), the CPU-device sizes (`cpu-device`) or small ones.
        #[arg(long, default_value = "small")]
        size: String,
    },
    /// Times compiling or loading every kernel on the CUDA backend (cold when the cache is empty).
    Startup,
    /// The main job of `make run`: a realistic Mamba-3 layer's kernels (preprocess and SISO scan,
    /// forward and backward) on the default device, checked against the CPU reference and for
    /// determinism.
    Demo {
        #[arg(long, default_value = "vulkan")]
        backend: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Op { op, backend, inputs, output } => run_op(&op, &backend, &inputs, &output),
        Command::Devices => devices(),
        Command::Ops => {
            for op in ops::OPS {
                println!("{}", op.name());
            }
            Ok(())
        }
        Command::Bench { backend, ops, repeats, small, detail, scalars, save_for_backward } => {
            bench(&backend, ops.as_deref(), repeats, small, detail, &scalars, save_for_backward)
        }
        Command::Compare { backends, size } => compare(&backends, &size),
        Command::Startup => startup(),
        Command::Demo { backend } => demo(&backend),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let text = format!("{error:#}").replace('\n', " ");
            eprintln!("error: {text}");
            ExitCode::FAILURE
        }
    }
}

fn open(backend: &str) -> Result<Device> {
    let kind: BackendKind = backend.parse()?;
    Ok(Device::open(kind)?)
}

/// Reads every tensor (all must be F32) and the string metadata.
fn read_safetensors(path: &Path) -> Result<(TensorMap, Scalars)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let (_, metadata) =
        SafeTensors::read_metadata(&bytes).map_err(|e| anyhow!("{}: not a safetensors file: {e}", path.display()))?;
    let scalars: Scalars = metadata.metadata().clone().unwrap_or_default().into_iter().collect();
    let file = SafeTensors::deserialize(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mut tensors = TensorMap::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            bail!("tensor `{name}`: dtype {:?}, expected F32", view.dtype());
        }
        let data: Vec<f32> =
            view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        tensors.insert(name.clone(), Tensor::new(view.shape().to_vec(), data)?);
    }
    Ok((tensors, scalars))
}

/// Writes to a temporary file beside `path`, then renames it into place.
fn write_safetensors(path: &Path, tensors: &TensorMap, metadata: HashMap<String, String>) -> Result<()> {
    let byte_data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| (name.clone(), t.shape().to_vec(), t.data().iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let views = byte_data
        .iter()
        .map(|(name, shape, bytes)| {
            Ok((name.clone(), safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), bytes)?))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| anyhow!("{e}"))?;
    let file_name = path.file_name().ok_or_else(|| anyhow!("{}: not a file path", path.display()))?;
    let temporary = path.with_file_name(format!(".{}.{}.tmp", file_name.to_string_lossy(), std::process::id()));
    let written = safetensors::serialize_to_file(views, Some(metadata), &temporary)
        .map_err(|e| anyhow!("writing {}: {e}", temporary.display()))
        .and_then(|_| std::fs::rename(&temporary, path).with_context(|| format!("renaming to {}", path.display())));
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

fn run_op(op: &str, backend: &str, inputs: &Path, output: &Path) -> Result<()> {
    let op = ops::find(op)?;
    let (tensors, scalars) = read_safetensors(inputs)?;
    let device = open(backend)?;
    let outputs = op.run(&device, &tensors, &scalars)?;
    let mut metadata = HashMap::new();
    metadata.insert("op".to_string(), op.name().to_string());
    metadata.insert("backend".to_string(), device.kind().to_string());
    metadata.insert("device".to_string(), device.description());
    write_safetensors(output, &outputs, metadata)
}

fn devices() -> Result<()> {
    println!("cpu: available: f64 reference");
    #[cfg(feature = "vulkan")]
    match mamba_kernels::backend::vulkan::list_devices() {
        Ok(list) if list.is_empty() => println!("vulkan: absent: the loader found no devices"),
        Ok(list) => {
            let chosen = Device::open(BackendKind::Vulkan);
            match &chosen {
                Ok(device) => println!(
                    "vulkan: available: default device {}, matrix path {}",
                    device.description(),
                    device.gpu().map_or("-", |g| g.matrix_path().name())
                ),
                Err(error) => println!("vulkan: absent: {error}"),
            }
            for d in list {
                let status =
                    if d.missing.is_empty() { "usable".to_string() } else { format!("lacks {}", d.missing.join(", ")) };
                println!("  [{}] {} ({}, Vulkan {}, {}): {status}", d.index, d.name, d.kind, d.api_version, d.driver);
                match &d.tensor_cores {
                    Ok(()) => println!("      tensor cores: bf16 cooperative matrices (16x16x16, f32 accumulation)"),
                    Err(lack) => println!("      tensor cores: none (lacks {lack})"),
                }
            }
        }
        Err(error) => println!("vulkan: absent: {error}"),
    }
    #[cfg(not(feature = "vulkan"))]
    println!("vulkan: absent: built without the `vulkan` feature");
    match Device::open(BackendKind::Cuda) {
        Ok(device) => println!("cuda: available: {}", device.description()),
        Err(error) => println!("cuda: absent: {error}"),
    }
    Ok(())
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// GPU time of `dispatches`, median of `repeats`, after `gpu::warm_up` (an idle GPU runs short
/// submissions at a fraction of its clock).
fn timed(gpu: &dyn Gpu, dispatches: &[Dispatch], repeats: usize) -> Result<f64> {
    mamba_kernels::gpu::warm_up(gpu, dispatches)?;
    let mut times = gpu.time(dispatches, repeats)?;
    Ok(median(&mut times))
}

fn bench(
    backend: &str,
    names: Option<&str>,
    repeats: usize,
    small: bool,
    detail: bool,
    overrides: &[String],
    save_for_backward: bool,
) -> Result<()> {
    let overrides = overrides
        .iter()
        .map(|o| o.split_once('=').ok_or_else(|| anyhow!("--scalar `{o}`: expected NAME=VALUE")))
        .collect::<Result<Vec<_>>>()?;
    let device = open(backend)?;
    let gpu = device.gpu().ok_or_else(|| anyhow!("bench needs a GPU backend (vulkan or cuda)"))?;
    let size = if small || gpu.is_cpu() { ExampleSize::CpuDevice } else { ExampleSize::Gpu };
    let selected: Vec<&dyn ops::Op> = match names {
        None => ops::OPS.to_vec(),
        Some(list) => list.split(',').map(|n| ops::find(n.trim())).collect::<Result<_, _>>()?,
    };
    let copy = mamba_kernels::gpu::copy_bandwidth(gpu, repeats)?;
    println!("device: {}", device.description());
    println!("copy bandwidth (read+write): {:.1} GB/s; sizes: {size:?}; median of {repeats} runs", copy / 1e9);
    println!();
    println!("| op | time (µs) | traffic (MB) | GB/s | % of copy | GFLOP/s |");
    println!("|---|---:|---:|---:|---:|---:|");
    for op in selected {
        let (mut inputs, mut scalars) = op.example(size, 1);
        for (name, value) in &overrides {
            scalars.set(name, value);
        }
        let mut label = op.name().to_string();
        if save_for_backward {
            match op.name() {
                "mamba3_siso_fwd" => scalars.set("save_for_backward", "1"),
                "mamba3_siso_bwd" => inputs = ops::mamba3_siso::with_saved_forward(&device, &inputs, &scalars)?,
                _ => {}
            }
            if op.name().starts_with("mamba3_siso_") {
                label.push_str(" (saved for backward)");
            }
        }
        let prepared = op.prepare(gpu, &inputs, &scalars)?;
        let seconds = timed(gpu, &prepared.recorded.dispatches, repeats)?;
        let rate = prepared.traffic_bytes as f64 / seconds;
        let flops =
            if prepared.flops > 0 { format!("{:.0}", prepared.flops as f64 / seconds / 1e9) } else { "-".into() };
        println!(
            "| {} | {:.1} | {:.1} | {:.0} | {:.0}% | {} |",
            label,
            seconds * 1e6,
            prepared.traffic_bytes as f64 / 1e6,
            rate / 1e9,
            100.0 * rate / copy,
            flops
        );
        if detail && prepared.recorded.dispatches.len() > 1 {
            gpu.run(&prepared.recorded.dispatches)?;
            // The list cut after each dispatch, then each dispatch alone: a dispatch that costs
            // more inside the sequence than alone shows up as a larger step between prefixes.
            let all = &prepared.recorded.dispatches;
            let mut previous = 0.0;
            for count in 1..all.len() {
                let prefix = timed(gpu, &all[..count], repeats)? * 1e6;
                println!("|   first {count} dispatches | {prefix:.1} (+{:.1}) | | | | |", prefix - previous);
                previous = prefix;
            }
            for dispatch in &prepared.recorded.dispatches {
                let alone = timed(gpu, std::slice::from_ref(dispatch), repeats)?;
                println!("|   {} {:?} | {:.1} | | | | |", dispatch.kernel.label(), dispatch.groups, alone * 1e6);
            }
        }
    }
    Ok(())
}

fn demo(backend: &str) -> Result<()> {
    let device = open(backend)?;
    let gpu = device.gpu().ok_or_else(|| anyhow!("the demo runs on a GPU backend (vulkan or cuda)"))?;
    let size = if gpu.is_cpu() { ExampleSize::CpuDevice } else { ExampleSize::Gpu };
    println!("device: {}", device.description());
    let cpu = Device::cpu();
    // the SISO backward twice: recomputing everything, and given what the forward saves for it
    let steps = [
        ("mamba3_preprocess_fwd", false),
        ("mamba3_preprocess_bwd", false),
        ("mamba3_siso_fwd", false),
        ("mamba3_siso_bwd", false),
        ("mamba3_siso_bwd", true),
    ];
    for (name, saved) in steps {
        let op = ops::find(name)?;
        let example = |size| -> Result<(TensorMap, Scalars)> {
            let (inputs, scalars) = op.example(size, 2026);
            if !saved {
                return Ok((inputs, scalars));
            }
            Ok((ops::mamba3_siso::with_saved_forward(&device, &inputs, &scalars)?, scalars))
        };
        let label = if saved { format!("{name} (given what the forward saved)") } else { name.to_string() };
        // Timing at the realistic size of the device; the reference check at the CPU-device size,
        // where the sequential f64 reference takes seconds rather than minutes.
        let (inputs, scalars) = example(size)?;
        let prepared = op.prepare(gpu, &inputs, &scalars)?;
        let seconds = timed(gpu, &prepared.recorded.dispatches, 10)?;
        let (input_name, tensor) =
            inputs.iter().max_by_key(|(_, t)| t.len()).ok_or_else(|| anyhow!("{name}: empty example"))?;
        println!(
            "{label}: `{input_name}` {:?}: GPU {:.1} µs ({:.0} GB/s, {:.0} GFLOP/s)",
            tensor.shape(),
            seconds * 1e6,
            prepared.traffic_bytes as f64 / seconds / 1e9,
            prepared.flops as f64 / seconds / 1e9
        );
        drop(prepared);
        let (inputs, scalars) = example(ExampleSize::CpuDevice)?;
        let started = Instant::now();
        let reference = op.run(&cpu, &inputs, &scalars)?;
        let reference_seconds = started.elapsed().as_secs_f64();
        let first = op.run(&device, &inputs, &scalars)?;
        let repeats_equal = (0..2).all(|_| match op.run(&device, &inputs, &scalars) {
            Ok(again) => first.iter().all(|(k, v)| bitwise_equal(v, &again[k])),
            Err(_) => false,
        });
        println!(
            "  checked at the CPU-device size: reference {reference_seconds:.2} s; bitwise repeatable over 3 runs: {}",
            if repeats_equal { "yes" } else { "NO" }
        );
        let mut worst: f64 = 0.0;
        for (output, want) in &reference {
            let error = relative_error(&first[output], want);
            worst = worst.max(error);
            println!("  {output:<18} {:?}  error vs reference {error:.2e}", want.shape());
        }
        if !repeats_equal || worst > 3e-4 {
            bail!("{label}: results are not repeatable or not within tolerance");
        }
    }
    Ok(())
}

fn compare(backends: &str, size: &str) -> Result<()> {
    let size = match size {
        "small" => ExampleSize::Small,
        "cpu-device" => ExampleSize::CpuDevice,
        "gpu" => ExampleSize::Gpu,
        other => bail!("unknown size {other:?}; expected small, cpu-device or gpu"),
    };
    let devices: Vec<Device> = backends.split(',').map(|b| open(b.trim())).collect::<Result<_>>()?;
    for device in &devices {
        println!("{}: {}", device.kind(), device.description());
    }
    let cpu = Device::cpu();
    println!();
    println!(
        "| op | output | max rel diff {} | each vs reference |",
        devices.iter().map(|d| d.kind().name()).collect::<Vec<_>>().join(" vs ")
    );
    println!("|---|---|---:|---|");
    for op in ops::OPS {
        let (inputs, scalars) = op.example(size, 7);
        let reference = op.run(&cpu, &inputs, &scalars)?;
        let results: Vec<TensorMap> = devices.iter().map(|d| op.run(d, &inputs, &scalars)).collect::<Result<_, _>>()?;
        for (name, want) in &reference {
            let between = if results.len() >= 2 { relative_error(&results[1][name], &results[0][name]) } else { 0.0 };
            let against: Vec<String> =
                results.iter().map(|r| format!("{:.1e}", relative_error(&r[name], want))).collect();
            println!("| {} | {name} | {between:.2e} | {} |", op.name(), against.join(", "));
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn startup() -> Result<()> {
    let started = Instant::now();
    let gpu = mamba_kernels::backend::cuda::CudaGpu::new()?;
    let opened = started.elapsed();
    let times = gpu.load_all_kernels()?;
    println!(
        "cuda start: device opened in {:.1} ms; {} kernel files ({} compiled with NVRTC, {} from the disk cache) in {:.1} ms",
        opened.as_secs_f64() * 1e3,
        times.compiled + times.from_disk + times.from_memory,
        times.compiled,
        times.from_disk,
        times.elapsed.as_secs_f64() * 1e3
    );
    for (kernel, registers, local, shared) in gpu.kernel_resources()? {
        println!("  {kernel}: {registers} registers, {local} bytes local (spill), {shared} bytes shared");
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn startup() -> Result<()> {
    bail!("built without the `cuda` feature")
}
