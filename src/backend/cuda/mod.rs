//! The CUDA backend: the same Slang kernels, emitted as CUDA C++ by `slangc -target cuda` and
//! compiled at run time with NVRTC, driven through cudarc's dynamically loaded driver API.
//!
//! Launch ABI. Slang's CUDA output reads the address table (shaders/common/storage.slang) through
//! a `__constant__` global, `SLANG_globalParams = { StructuredBuffer<uint64_t> buffer_addresses }`,
//! where `StructuredBuffer<T> = { T* data; size_t count }`. We keep one device table of addresses,
//! one per buffer slot (0 for a free one), and point each module's global at it once (again only if
//! the table moves). Push constants are an entry-point `uniform` parameter in every kernel, which
//! Slang emits as a by-value kernel argument, so a launch is a plain `cuLaunchKernel` with no
//! per-launch copy.
//! One stream per backend; events time the GPU work.

pub mod compile;

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use crate::error::{Error, Result};
use crate::gpu::{Dispatch, Gpu, GpuBuffer, SlotOwner};
use crate::kernels::KERNEL_FILES;

/// Selects the device by ordinal (default 0).
pub const DEVICE_ENV: &str = "MAMBA_CUDA_DEVICE";
/// Upper bound on live buffers (slots in the device buffer table).
const MAX_SLOTS: u32 = 16384;
/// Bytes of one table record: a device address.
const RECORD_BYTES: usize = 8;
/// Bytes of `SLANG_globalParams`: the table's `{pointer, count}`.
const GLOBALS_BYTES: usize = 16;

fn driver_error(call: &'static str, status: cu::CUresult) -> Error {
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string or leaves it null.
    let described = unsafe { cu::cuGetErrorString(status, &mut text) };
    let reason = if described == cu::CUresult::CUDA_SUCCESS && !text.is_null() {
        // SAFETY: a static NUL-terminated string from the driver.
        format!("{status:?}: {}", unsafe { CStr::from_ptr(text) }.to_string_lossy())
    } else {
        format!("{status:?}")
    };
    Error::CudaDriver { call, reason }
}

fn check(call: &'static str, status: cu::CUresult) -> Result<()> {
    if status == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(call, status))
    }
}

/// Whether the CUDA driver and NVRTC libraries can be loaded, and if not, why.
pub fn libraries_present() -> Result<()> {
    // SAFETY: these only try to open the shared libraries; they never panic.
    if !unsafe { cu::is_culib_present() } {
        return Err(Error::DeviceUnavailable {
            backend: "cuda",
            reason: "the CUDA driver library (libcuda.so) cannot be loaded".into(),
        });
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::DeviceUnavailable {
            backend: "cuda",
            reason: "NVRTC (libnvrtc.so) cannot be loaded; add the CUDA toolkit's lib folder to LD_LIBRARY_PATH".into(),
        });
    }
    Ok(())
}

struct LoadedModule {
    module: cu::CUmodule,
    functions: Vec<cu::CUfunction>,
    globals: cu::CUdeviceptr,
    table_generation: u64,
}

struct CudaState {
    buffers: Vec<Option<(cu::CUdeviceptr, u64)>>,
    free_slots: Vec<u32>,
    table: cu::CUdeviceptr,
    table_generation: u64,
    modules: HashMap<usize, LoadedModule>,
    events: Vec<cu::CUevent>,
}

struct CudaShared {
    context: cu::CUcontext,
    device: cu::CUdevice,
    stream: cu::CUstream,
    description: String,
    arch: String,
    driver_version: i32,
    state: Mutex<CudaState>,
}

// SAFETY: the raw CUDA handles are used only while the context is made current on the calling
// thread and under the state mutex; the driver API is thread-safe for that use.
unsafe impl Send for CudaShared {}
unsafe impl Sync for CudaShared {}

/// The CUDA backend.
pub struct CudaGpu {
    shared: Arc<CudaShared>,
}

/// Cold and warm start of the whole kernel set (compile or load every kernel file).
#[derive(Clone, Debug)]
pub struct StartTimes {
    pub compiled: usize,
    pub from_disk: usize,
    pub from_memory: usize,
    pub elapsed: Duration,
}

impl CudaGpu {
    /// Opens device `MAMBA_CUDA_DEVICE` (default 0), after checking that the libraries load.
    pub fn new() -> Result<Self> {
        libraries_present()?;
        let ordinal: i32 = match std::env::var(DEVICE_ENV) {
            Ok(text) => text.trim().parse().map_err(|_| Error::DeviceUnavailable {
                backend: "cuda",
                reason: format!("{DEVICE_ENV}={text:?} is not a device ordinal"),
            })?,
            Err(_) => 0,
        };
        // SAFETY: driver calls with valid out-pointers; the library is present.
        unsafe {
            let status = cu::cuInit(0);
            if status != cu::CUresult::CUDA_SUCCESS {
                return Err(Error::DeviceUnavailable {
                    backend: "cuda",
                    reason: format!(
                        "cuInit failed ({}); no usable NVIDIA GPU or driver",
                        driver_error("cuInit", status)
                    ),
                });
            }
            let mut count = 0;
            check("cuDeviceGetCount", cu::cuDeviceGetCount(&mut count))?;
            if ordinal < 0 || ordinal >= count {
                return Err(Error::DeviceUnavailable {
                    backend: "cuda",
                    reason: format!("device ordinal {ordinal} requested, {count} CUDA device(s) present"),
                });
            }
            let mut device: cu::CUdevice = 0;
            check("cuDeviceGet", cu::cuDeviceGet(&mut device, ordinal))?;
            let mut name = [0 as std::ffi::c_char; 256];
            check("cuDeviceGetName", cu::cuDeviceGetName(name.as_mut_ptr(), 256, device))?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let attribute = |a: cu::CUdevice_attribute| -> Result<i32> {
                let mut value = 0;
                check("cuDeviceGetAttribute", cu::cuDeviceGetAttribute(&mut value, a, device))?;
                Ok(value)
            };
            let major = attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let mut driver_version = 0;
            check("cuDriverGetVersion", cu::cuDriverGetVersion(&mut driver_version))?;
            let (nvrtc_major, nvrtc_minor) = compile::nvrtc_version()?;
            let mut context: cu::CUcontext = std::ptr::null_mut();
            check("cuDevicePrimaryCtxRetain", cu::cuDevicePrimaryCtxRetain(&mut context, device))?;
            check("cuCtxSetCurrent", cu::cuCtxSetCurrent(context))?;
            let mut stream: cu::CUstream = std::ptr::null_mut();
            check(
                "cuStreamCreate",
                cu::cuStreamCreate(&mut stream, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            )?;
            let mut table: cu::CUdeviceptr = 0;
            let table_bytes = MAX_SLOTS as usize * RECORD_BYTES;
            check("cuMemAlloc", cu::cuMemAlloc_v2(&mut table, table_bytes))?;
            check("cuMemsetD8", cu::cuMemsetD8_v2(table, 0, table_bytes))?;
            let description = format!(
                "{name} (CUDA, sm_{major}{minor}, driver {}.{}, NVRTC {nvrtc_major}.{nvrtc_minor})",
                driver_version / 1000,
                (driver_version % 1000) / 10
            );
            Ok(CudaGpu {
                shared: Arc::new(CudaShared {
                    context,
                    device,
                    stream,
                    description,
                    arch: format!("sm_{major}{minor}"),
                    driver_version,
                    state: Mutex::new(CudaState {
                        buffers: Vec::new(),
                        free_slots: Vec::new(),
                        table,
                        table_generation: 1,
                        modules: HashMap::new(),
                        events: Vec::new(),
                    }),
                }),
            })
        }
    }

    /// Compiles or loads every kernel file, and reports where each came from and how long it took:
    /// the first call in a fresh cache directory is the cold start, a later process the warm one.
    pub fn load_all_kernels(&self) -> Result<StartTimes> {
        let shared = &self.shared;
        let started = Instant::now();
        let mut times = StartTimes { compiled: 0, from_disk: 0, from_memory: 0, elapsed: Duration::ZERO };
        let mut state = shared.lock()?;
        for index in (0..KERNEL_FILES.len()).filter(|&i| KERNEL_FILES[i].cuda_source.is_some()) {
            match shared.module(&mut state, index)? {
                Some(compile::Origin::Compiled) => times.compiled += 1,
                Some(compile::Origin::Disk) => times.from_disk += 1,
                Some(compile::Origin::Memory) | None => times.from_memory += 1,
            }
        }
        times.elapsed = started.elapsed();
        Ok(times)
    }

    /// Registers, local (spill) bytes and static shared bytes of every loaded entry point.
    pub fn kernel_resources(&self) -> Result<Vec<(String, i32, i32, i32)>> {
        let shared = &self.shared;
        let state = shared.lock()?;
        let mut rows = Vec::new();
        let mut files: Vec<&usize> = state.modules.keys().collect();
        files.sort();
        for &index in files {
            let loaded = &state.modules[&index];
            for (entry, &function) in KERNEL_FILES[index].entry_points.iter().zip(&loaded.functions) {
                let attribute = |a: cu::CUfunction_attribute| -> Result<i32> {
                    let mut value = 0;
                    // SAFETY: a function of a loaded module.
                    check("cuFuncGetAttribute", unsafe { cu::cuFuncGetAttribute(&mut value, a, function) })?;
                    Ok(value)
                };
                rows.push((
                    format!("{}::{}", KERNEL_FILES[index].name, entry.name),
                    attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
                    attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
                    attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
                ));
            }
        }
        Ok(rows)
    }

    /// The architecture kernels are compiled for, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.shared.arch
    }
}

impl CudaShared {
    /// Locks the state and makes the context current on this thread.
    fn lock(&self) -> Result<MutexGuard<'_, CudaState>> {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: a valid retained context.
        check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(self.context) })?;
        Ok(guard)
    }

    /// Loads kernel file `index` into this context (compiling it if needed); returns where the
    /// cubin came from when it was loaded now, `None` when it already was.
    fn module(&self, state: &mut CudaState, index: usize) -> Result<Option<compile::Origin>> {
        if state.modules.contains_key(&index) {
            return Ok(None);
        }
        let file = KERNEL_FILES.get(index).ok_or_else(|| Error::Dispatch(format!("no kernel file {index}")))?;
        let (cubin, origin) = compile::cubin(index, file, &self.arch, self.driver_version)?;
        let mut module: cu::CUmodule = std::ptr::null_mut();
        // SAFETY: a cubin NVRTC produced for this architecture.
        let status = unsafe { cu::cuModuleLoadData(&mut module, cubin.as_ptr() as *const c_void) };
        if status != cu::CUresult::CUDA_SUCCESS {
            compile::forget(index, file, &self.arch, self.driver_version);
            return Err(driver_error("cuModuleLoadData", status));
        }
        let mut functions = Vec::new();
        for entry in file.entry_points {
            let name =
                CString::new(entry.name).map_err(|_| Error::Dispatch(format!("bad entry name {}", entry.name)))?;
            let mut function: cu::CUfunction = std::ptr::null_mut();
            // SAFETY: valid module and NUL-terminated name.
            check("cuModuleGetFunction", unsafe { cu::cuModuleGetFunction(&mut function, module, name.as_ptr()) })?;
            functions.push(function);
        }
        let mut globals: cu::CUdeviceptr = 0;
        let mut size = 0usize;
        // SAFETY: valid module; the name is Slang's fixed global.
        check("cuModuleGetGlobal(SLANG_globalParams)", unsafe {
            cu::cuModuleGetGlobal_v2(&mut globals, &mut size, module, c"SLANG_globalParams".as_ptr())
        })?;
        if size != GLOBALS_BYTES {
            return Err(Error::Dispatch(format!(
                "{}: SLANG_globalParams is {size} bytes; expected the address table alone ({GLOBALS_BYTES})",
                file.name
            )));
        }
        state.modules.insert(index, LoadedModule { module, functions, globals, table_generation: 0 });
        Ok(Some(origin))
    }

    /// Points a module's `SLANG_globalParams` at the buffer table (once per table generation).
    fn bind_table(&self, state: &mut CudaState, index: usize) -> Result<()> {
        let (table, generation) = (state.table, state.table_generation);
        let loaded = state.modules.get_mut(&index).ok_or_else(|| Error::Dispatch("module not loaded".into()))?;
        if loaded.table_generation == generation {
            return Ok(());
        }
        let record: [u64; 2] = [table, u64::from(MAX_SLOTS)];
        // SAFETY: a 16-byte __constant__ global; the stream is idle (every call synchronises).
        check("cuMemcpyHtoD(SLANG_globalParams)", unsafe {
            cu::cuMemcpyHtoD_v2(loaded.globals, record.as_ptr() as *const c_void, GLOBALS_BYTES)
        })?;
        loaded.table_generation = generation;
        Ok(())
    }

    fn write_record(&self, state: &CudaState, slot: u32, pointer: u64) -> Result<()> {
        let record: [u64; 1] = [pointer];
        // SAFETY: the slot is below MAX_SLOTS, so the record lies inside the table.
        check("cuMemcpyHtoD(buffer table)", unsafe {
            cu::cuMemcpyHtoD_v2(
                state.table + u64::from(slot) * RECORD_BYTES as u64,
                record.as_ptr() as *const c_void,
                RECORD_BYTES,
            )
        })
    }

    fn buffer(&self, state: &CudaState, buffer: &GpuBuffer) -> Result<(cu::CUdeviceptr, u64)> {
        state
            .buffers
            .get(buffer.slot() as usize)
            .copied()
            .flatten()
            .ok_or_else(|| Error::Dispatch(format!("buffer slot {} is not a live CUDA buffer", buffer.slot())))
    }

    fn prepare(&self, state: &mut CudaState, dispatches: &[Dispatch]) -> Result<()> {
        for dispatch in dispatches {
            self.module(state, dispatch.kernel.file)?;
            self.bind_table(state, dispatch.kernel.file)?;
        }
        Ok(())
    }

    fn launch(&self, state: &CudaState, dispatches: &[Dispatch]) -> Result<()> {
        for dispatch in dispatches {
            let loaded =
                state.modules.get(&dispatch.kernel.file).ok_or_else(|| Error::Dispatch("not loaded".into()))?;
            let function = *loaded
                .functions
                .get(dispatch.kernel.entry)
                .ok_or_else(|| Error::Dispatch(format!("no entry {}", dispatch.kernel.label())))?;
            let threads = dispatch.kernel.entry_point().threads;
            // The single kernel argument is the push-constant struct, passed by value.
            let mut push = [0u64; 16];
            let bytes = dispatch.push_bytes();
            bytemuck::cast_slice_mut::<u64, u8>(&mut push)[..bytes.len()].copy_from_slice(bytes);
            let mut arguments = [push.as_mut_ptr() as *mut c_void];
            // SAFETY: a function of a loaded module; the argument points at the push bytes, which
            // outlive the call (the driver copies kernel arguments at launch).
            check("cuLaunchKernel", unsafe {
                cu::cuLaunchKernel(
                    function,
                    dispatch.groups[0],
                    dispatch.groups[1],
                    dispatch.groups[2],
                    threads[0],
                    threads[1],
                    threads[2],
                    0,
                    self.stream,
                    arguments.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            })
            .map_err(|e| match e {
                Error::CudaDriver { reason, .. } => Error::CudaDriver {
                    call: "cuLaunchKernel",
                    reason: format!("{}: {reason}", dispatch.kernel.label()),
                },
                other => other,
            })?;
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        // SAFETY: a valid stream.
        check("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(self.stream) })
    }

    fn ensure_events(&self, state: &mut CudaState, count: usize) -> Result<()> {
        while state.events.len() < count {
            let mut event: cu::CUevent = std::ptr::null_mut();
            // SAFETY: valid out-pointer; default flags keep timing enabled.
            check("cuEventCreate", unsafe { cu::cuEventCreate(&mut event, 0) })?;
            state.events.push(event);
        }
        Ok(())
    }

    /// Records `work` between event pairs (one pair per repetition), then returns the seconds of each.
    fn timed(&self, events: &[cu::CUevent], work: &dyn Fn() -> Result<()>) -> Result<Vec<f64>> {
        for pair in events.chunks_exact(2) {
            // SAFETY: valid events and stream.
            check("cuEventRecord", unsafe { cu::cuEventRecord(pair[0], self.stream) })?;
            work()?;
            check("cuEventRecord", unsafe { cu::cuEventRecord(pair[1], self.stream) })?;
        }
        self.synchronize()?;
        events
            .chunks_exact(2)
            .map(|pair| {
                let mut milliseconds = 0f32;
                // SAFETY: both events have completed.
                check("cuEventElapsedTime", unsafe { cu::cuEventElapsedTime(&mut milliseconds, pair[0], pair[1]) })?;
                Ok(f64::from(milliseconds) * 1e-3)
            })
            .collect()
    }

    /// The first `count` timing events, creating them as needed.
    fn events(&self, state: &mut CudaState, count: usize) -> Result<Vec<cu::CUevent>> {
        self.ensure_events(state, count)?;
        Ok(state.events[..count].to_vec())
    }
}

impl SlotOwner for CudaShared {
    fn release(&self, slot: u32) {
        let Ok(mut state) = self.lock() else { return };
        if let Some((pointer, _)) = state.buffers.get_mut(slot as usize).and_then(Option::take) {
            let _ = self.write_record(&state, slot, 0);
            // SAFETY: no pending work uses the buffer (every call synchronises).
            unsafe { cu::cuMemFree_v2(pointer) };
            state.free_slots.push(slot);
        }
    }
}

impl Drop for CudaShared {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the device is idle after the synchronise and nothing else holds these handles.
        unsafe {
            cu::cuCtxSetCurrent(self.context);
            cu::cuStreamSynchronize(self.stream);
            for event in state.events.drain(..) {
                cu::cuEventDestroy_v2(event);
            }
            for (_, loaded) in state.modules.drain() {
                cu::cuModuleUnload(loaded.module);
            }
            for (pointer, _) in state.buffers.drain(..).flatten() {
                cu::cuMemFree_v2(pointer);
            }
            cu::cuMemFree_v2(state.table);
            cu::cuStreamDestroy_v2(self.stream);
            cu::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

impl Gpu for CudaGpu {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn device_name(&self) -> String {
        self.shared.description.clone()
    }

    /// Kernels index buffers with 32-bit byte offsets.
    fn max_buffer_bytes(&self) -> u64 {
        u64::from(u32::MAX) - 15
    }

    fn alloc(&self, elements: usize) -> Result<GpuBuffer> {
        let shared = &self.shared;
        let bytes = ((elements.max(1) as u64 * 4).div_ceil(16) * 16).max(16);
        let mut state = shared.lock()?;
        let slot = match state.free_slots.pop() {
            Some(slot) => slot,
            None => {
                let next = state.buffers.len() as u32;
                if next >= MAX_SLOTS {
                    return Err(Error::Allocation {
                        bytes,
                        reason: format!("all {MAX_SLOTS} buffer slots are in use"),
                    });
                }
                state.buffers.push(None);
                next
            }
        };
        let mut pointer: cu::CUdeviceptr = 0;
        // SAFETY: valid out-pointer in a current context.
        let status = unsafe { cu::cuMemAlloc_v2(&mut pointer, bytes as usize) };
        if status != cu::CUresult::CUDA_SUCCESS {
            state.free_slots.push(slot);
            return Err(Error::Allocation { bytes, reason: driver_error("cuMemAlloc", status).to_string() });
        }
        if let Err(e) = shared.write_record(&state, slot, pointer) {
            unsafe { cu::cuMemFree_v2(pointer) };
            state.free_slots.push(slot);
            return Err(e);
        }
        state.buffers[slot as usize] = Some((pointer, bytes));
        drop(state);
        Ok(GpuBuffer::new(slot, elements, shared.clone()))
    }

    fn upload(&self, buffer: &GpuBuffer, data: &[f32]) -> Result<()> {
        if data.len() != buffer.elements() {
            return Err(Error::Dispatch(format!(
                "upload of {} values into a buffer of {}",
                data.len(),
                buffer.elements()
            )));
        }
        let state = self.shared.lock()?;
        let (pointer, _) = self.shared.buffer(&state, buffer)?;
        // SAFETY: the buffer holds at least data.len() floats; the stream is idle.
        check("cuMemcpyHtoD", unsafe {
            cu::cuMemcpyHtoD_v2(pointer, data.as_ptr() as *const c_void, std::mem::size_of_val(data))
        })
    }

    fn download(&self, buffer: &GpuBuffer) -> Result<Vec<f32>> {
        let state = self.shared.lock()?;
        let (pointer, _) = self.shared.buffer(&state, buffer)?;
        let mut out = vec![0f32; buffer.elements()];
        // SAFETY: the buffer holds out.len() floats; all kernels have completed.
        check("cuMemcpyDtoH", unsafe { cu::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, pointer, out.len() * 4) })?;
        Ok(out)
    }

    fn run(&self, dispatches: &[Dispatch]) -> Result<()> {
        let shared = &self.shared;
        let mut state = shared.lock()?;
        shared.prepare(&mut state, dispatches)?;
        shared.launch(&state, dispatches)?;
        shared.synchronize()
    }

    fn time(&self, dispatches: &[Dispatch], repeats: usize) -> Result<Vec<f64>> {
        let shared = &self.shared;
        let mut state = shared.lock()?;
        shared.prepare(&mut state, dispatches)?;
        let events = shared.events(&mut state, 2 * repeats.max(1))?;
        let state = &*state;
        shared.timed(&events, &|| shared.launch(state, dispatches))
    }
}
