//! Ops: one file per op family, each holding its params, validation, launch glue and f64 reference.
//! [`OpDef`] is what an op file implements; [`Op`] is the object-safe face the registry, the runner
//! and the tests use.

use std::collections::BTreeMap;
use std::marker::PhantomData;

use crate::backend::Device;
use crate::error::{Error, Result};
use crate::gpu::{Dispatch, Gpu, GpuBuffer};
use crate::tensor::{element_count, Scalars, Tensor, TensorMap};

pub mod causal_conv1d;
pub mod check;
pub mod mamba3_preprocess;
pub mod mamba3_siso;
pub mod math;
pub mod reduce;
pub mod rmsnorm;
pub mod selective_scan;

pub use check::{ScalarCheck, ShapeCheck};

/// A tensor in device memory.
#[derive(Debug)]
pub struct GpuTensor {
    pub buffer: GpuBuffer,
    pub shape: Vec<usize>,
}

/// Named device tensors.
pub type GpuTensors = BTreeMap<String, GpuTensor>;

/// What an op's launch glue produces: the outputs it allocated, the scratch it needs alive while
/// the dispatches run, and the dispatches themselves, in order.
#[derive(Debug, Default)]
pub struct Recorded {
    pub outputs: GpuTensors,
    pub scratch: Vec<GpuBuffer>,
    pub dispatches: Vec<Dispatch>,
}

impl Recorded {
    /// Allocates an output tensor, refusing one larger than a device buffer may be.
    pub fn output(&mut self, gpu: &dyn Gpu, op: &str, name: &str, shape: Vec<usize>) -> Result<u32> {
        let buffer = alloc_checked(gpu, op, name, &shape)?;
        let slot = buffer.slot();
        self.outputs.insert(name.to_string(), GpuTensor { buffer, shape });
        Ok(slot)
    }

    /// Allocates a scratch buffer (partial sums and the like).
    pub fn scratch(&mut self, gpu: &dyn Gpu, op: &str, name: &str, elements: usize) -> Result<u32> {
        let buffer = alloc_checked(gpu, op, name, &[elements])?;
        let slot = buffer.slot();
        self.scratch.push(buffer);
        Ok(slot)
    }
}

fn alloc_checked(gpu: &dyn Gpu, op: &str, name: &str, shape: &[usize]) -> Result<GpuBuffer> {
    let bytes = element_count(shape) as u64 * 4;
    if bytes > gpu.max_buffer_bytes() {
        return Err(Error::TooLarge {
            op: op.to_string(),
            tensor: name.to_string(),
            bytes,
            limit: gpu.max_buffer_bytes(),
            device: gpu.device_name(),
        });
    }
    gpu.alloc(element_count(shape).max(1))
}

/// The slot of an input tensor (inputs were checked by name before launch).
pub fn slot(inputs: &GpuTensors, op: &str, name: &str) -> Result<u32> {
    inputs.get(name).map(|t| t.buffer.slot()).ok_or_else(|| Error::tensor(op, name, "missing"))
}

/// The slot of an optional input, or `NO_BUFFER`.
pub fn optional_slot(inputs: &GpuTensors, name: &str) -> u32 {
    inputs.get(name).map_or(crate::gpu::NO_BUFFER, |t| t.buffer.slot())
}

/// What an op file implements.
pub trait OpDef: Send + Sync + 'static {
    /// The op's name in `spec/ops.md`.
    const NAME: &'static str;
    /// Everything validation derives from the inputs: sizes, flags, scalars.
    type Problem: Send + Sync;

    /// Validates tensor names and shapes and scalars, before any device work.
    fn check(shapes: &ShapeCheck, scalars: &ScalarCheck) -> Result<Self::Problem>;

    /// The f64 reference: the specification the GPU kernels are tested against.
    fn reference(problem: &Self::Problem, inputs: &TensorMap<f64>) -> TensorMap<f64>;

    /// Allocates outputs and scratch on the GPU and lists the dispatches that compute them.
    fn record(problem: &Self::Problem, gpu: &dyn Gpu, inputs: &GpuTensors) -> Result<Recorded>;

    /// The least DRAM traffic, in bytes, any implementation needs (the bandwidth floor).
    fn traffic_bytes(_problem: &Self::Problem) -> u64 {
        0
    }

    /// Floating-point operations of the algorithm (the compute floor).
    fn flops(_problem: &Self::Problem) -> u64 {
        0
    }

    /// Random inputs of a given size class (benchmarks, `make run`, the registry test).
    fn example(size: ExampleSize, seed: u64) -> (TensorMap, Scalars);

    /// Small inputs that together reach every entry point the op can dispatch (the registry test
    /// checks that every kernel is reached). One small example unless the op picks kernels by shape.
    fn coverage_examples(seed: u64) -> Vec<(TensorMap, Scalars)> {
        vec![Self::example(ExampleSize::Small, seed)]
    }
}

/// Size classes of example inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExampleSize {
    /// A few hundred elements: quick checks.
    Small,
    /// The benchmark size scaled down for a CPU device (lavapipe).
    CpuDevice,
    /// The benchmark size the issues name for a real GPU.
    Gpu,
}

/// An op prepared on a GPU: inputs uploaded, outputs allocated, dispatches ready to run or time.
pub struct Prepared {
    pub inputs: GpuTensors,
    pub recorded: Recorded,
    pub traffic_bytes: u64,
    pub flops: u64,
}

/// The object-safe face of an op.
pub trait Op: Send + Sync {
    fn name(&self) -> &'static str;
    /// Validates, runs once on `device`, returns the outputs.
    fn run(&self, device: &Device, inputs: &TensorMap, scalars: &Scalars) -> Result<TensorMap>;
    /// Validates, uploads and records, without running (for timing).
    fn prepare(&self, gpu: &dyn Gpu, inputs: &TensorMap, scalars: &Scalars) -> Result<Prepared>;
    /// Random inputs of a size class.
    fn example(&self, size: ExampleSize, seed: u64) -> (TensorMap, Scalars);
    /// Small inputs that together reach every entry point the op can dispatch.
    fn coverage_examples(&self, seed: u64) -> Vec<(TensorMap, Scalars)>;
}

struct Registered<T: OpDef>(PhantomData<T>);

fn shapes_of(inputs: &TensorMap) -> BTreeMap<String, Vec<usize>> {
    inputs.iter().map(|(k, v)| (k.clone(), v.shape().to_vec())).collect()
}

fn problem_of<T: OpDef>(inputs: &TensorMap, scalars: &Scalars) -> Result<T::Problem> {
    let shapes = shapes_of(inputs);
    let shape_check = ShapeCheck::new(T::NAME, &shapes);
    let scalar_check = ScalarCheck::new(T::NAME, scalars);
    let problem = T::check(&shape_check, &scalar_check)?;
    shape_check.finish()?;
    scalar_check.finish()?;
    Ok(problem)
}

impl<T: OpDef> Registered<T> {
    fn upload(gpu: &dyn Gpu, inputs: &TensorMap) -> Result<GpuTensors> {
        for (name, tensor) in inputs {
            let bytes = tensor.len() as u64 * 4;
            if bytes > gpu.max_buffer_bytes() {
                return Err(Error::TooLarge {
                    op: T::NAME.to_string(),
                    tensor: name.clone(),
                    bytes,
                    limit: gpu.max_buffer_bytes(),
                    device: gpu.device_name(),
                });
            }
        }
        let mut uploaded = GpuTensors::new();
        for (name, tensor) in inputs {
            let buffer = gpu.alloc(tensor.len().max(1))?;
            gpu.upload(&buffer, tensor.data())?;
            uploaded.insert(name.clone(), GpuTensor { buffer, shape: tensor.shape().to_vec() });
        }
        Ok(uploaded)
    }
}

impl<T: OpDef> Op for Registered<T> {
    fn name(&self) -> &'static str {
        T::NAME
    }

    fn run(&self, device: &Device, inputs: &TensorMap, scalars: &Scalars) -> Result<TensorMap> {
        match device.gpu() {
            None => {
                let problem = problem_of::<T>(inputs, scalars)?;
                let wide: TensorMap<f64> = inputs.iter().map(|(k, v)| (k.clone(), v.to_f64())).collect();
                Ok(T::reference(&problem, &wide).into_iter().map(|(k, v)| (k, v.to_f32())).collect())
            }
            Some(gpu) => {
                let prepared = self.prepare(gpu, inputs, scalars)?;
                gpu.run(&prepared.recorded.dispatches)?;
                let mut outputs = TensorMap::new();
                for (name, tensor) in &prepared.recorded.outputs {
                    let data = gpu.download(&tensor.buffer)?;
                    outputs.insert(name.clone(), Tensor::new(tensor.shape.clone(), data)?);
                }
                Ok(outputs)
            }
        }
    }

    fn example(&self, size: ExampleSize, seed: u64) -> (TensorMap, Scalars) {
        T::example(size, seed)
    }

    fn coverage_examples(&self, seed: u64) -> Vec<(TensorMap, Scalars)> {
        T::coverage_examples(seed)
    }

    fn prepare(&self, gpu: &dyn Gpu, inputs: &TensorMap, scalars: &Scalars) -> Result<Prepared> {
        let problem = problem_of::<T>(inputs, scalars)?;
        let uploaded = Self::upload(gpu, inputs)?;
        let recorded = T::record(&problem, gpu, &uploaded)?;
        Ok(Prepared {
            inputs: uploaded,
            recorded,
            traffic_bytes: T::traffic_bytes(&problem),
            flops: T::flops(&problem),
        })
    }
}

/// Every op, in the order of `spec/ops.md`.
pub static OPS: &[&dyn Op] = &[
    &Registered::<rmsnorm::RmsNormFwd>(PhantomData),
    &Registered::<rmsnorm::RmsNormBwd>(PhantomData),
    &Registered::<mamba3_preprocess::PreprocessFwd>(PhantomData),
    &Registered::<mamba3_preprocess::PreprocessBwd>(PhantomData),
    &Registered::<causal_conv1d::CausalConv1dFwd>(PhantomData),
    &Registered::<causal_conv1d::CausalConv1dBwd>(PhantomData),
    &Registered::<mamba3_siso::SisoFwd>(PhantomData),
    &Registered::<mamba3_siso::SisoBwd>(PhantomData),
    &Registered::<selective_scan::ScanFwd>(PhantomData),
    &Registered::<selective_scan::ScanBwd>(PhantomData),
];

/// The op called `name`.
pub fn find(name: &str) -> Result<&'static dyn Op> {
    OPS.iter().copied().find(|op| op.name() == name).ok_or_else(|| Error::UnknownOp {
        name: name.to_string(),
        known: OPS.iter().map(|op| op.name()).collect::<Vec<_>>().join(", "),
    })
}

/// Runs op `name` on `device`: the library's one-call entry point.
pub fn run(device: &Device, name: &str, inputs: &TensorMap, scalars: &Scalars) -> Result<TensorMap> {
    find(name)?.run(device, inputs, scalars)
}
