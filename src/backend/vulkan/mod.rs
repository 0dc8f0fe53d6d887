//! The Vulkan backend: `ash` loaded at run time, `gpu-allocator` for memory, bindless buffers
//! through buffer device addresses (one storage buffer, the address table, holds the device
//! address of every live buffer slot; kernels index it with the slots in their push constants and
//! access memory through the pointers), one pipeline layout for every kernel, a persisted pipeline
//! cache, batched recording with barriers, and timestamp queries. Every call is synchronous: it
//! submits and waits.
//!
//! Why addresses rather than a descriptor array of storage buffers: on NVIDIA the compiled kernels
//! re-fetched an indexed descriptor before most accesses and bounds-checked each one, and ran 2-6x
//! slower than the same kernels through CUDA (docs/PERFORMANCE.md, run 6).

pub mod pipeline_cache;
pub mod tensor_cores;

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use ash::vk;
use gpu_allocator::vulkan::{Allocation, AllocationCreateDesc, AllocationScheme, Allocator, AllocatorCreateDesc};
use gpu_allocator::MemoryLocation;

use crate::error::{Error, Result};
use crate::gpu::{Dispatch, Gpu, GpuBuffer, MatrixPath, SlotOwner, MAX_PUSH_CONSTANT_BYTES};
use crate::kernels::{KernelRef, KERNEL_FILES, SHADER_SET_HASH};
use pipeline_cache::CacheKey;

/// Selects the device: an index into the device list or a case-insensitive name substring.
pub const DEVICE_ENV: &str = "MAMBA_VK_DEVICE";
/// Set to 1 to enable the Khronos validation layer with synchronisation validation.
pub const VALIDATION_ENV: &str = "MAMBA_VK_VALIDATION";
/// Set to 1 to print each pipeline's compiler statistics (registers, spills, shared memory) on
/// creation, where the driver offers VK_KHR_pipeline_executable_properties.
pub const PIPELINE_STATS_ENV: &str = "MAMBA_VK_PIPELINE_STATS";
/// A directory: with MAMBA_VK_PIPELINE_STATS=1, also write the driver's internal representations
/// of each pipeline (on NVIDIA, the machine code) there, one text file per kernel and stage.
pub const PIPELINE_IR_ENV: &str = "MAMBA_VK_PIPELINE_IR_DIR";
/// A directory: write each pipeline alone in a fresh pipeline cache's data there (`<kernel>.bin`),
/// for disassembling the driver's machine code where it offers no text representation (NVIDIA).
pub const PIPELINE_BINARY_ENV: &str = "MAMBA_VK_PIPELINE_BINARY_DIR";

const VALIDATION_LAYER: &CStr = c"VK_LAYER_KHRONOS_validation";
/// Live buffers at most (slots in the address table).
const MAX_SLOTS: u32 = 16384;

fn vk_error(call: &'static str) -> impl Fn(vk::Result) -> Error {
    move |result| Error::Vulkan { call, result: format!("{result:?}") }
}

/// One physical device as `devices` reports it.
#[derive(Clone, Debug)]
pub struct DeviceReport {
    pub index: usize,
    pub name: String,
    pub kind: String,
    pub api_version: String,
    pub driver: String,
    /// Why the device cannot be used; empty when it can.
    pub missing: Vec<String>,
    /// Whether the tensor-core kernels can run, else what the device lacks for them.
    pub tensor_cores: tensor_cores::Support,
}

/// Validation-layer warnings and errors seen since the instance was made.
#[derive(Default)]
struct ValidationLog {
    messages: Mutex<Vec<String>>,
}

unsafe extern "system" fn debug_callback(
    severity: vk::DebugUtilsMessageSeverityFlagsEXT,
    _types: vk::DebugUtilsMessageTypeFlagsEXT,
    data: *const vk::DebugUtilsMessengerCallbackDataEXT<'_>,
    user: *mut c_void,
) -> vk::Bool32 {
    if severity
        .intersects(vk::DebugUtilsMessageSeverityFlagsEXT::WARNING | vk::DebugUtilsMessageSeverityFlagsEXT::ERROR)
    {
        // SAFETY: the layer passes valid callback data; `user` is the ValidationLog that outlives the messenger.
        let text = unsafe {
            if data.is_null() || (*data).p_message.is_null() {
                String::from("(no message)")
            } else {
                CStr::from_ptr((*data).p_message).to_string_lossy().into_owned()
            }
        };
        eprintln!("[vulkan validation] {text}");
        let log = unsafe { &*(user as *const ValidationLog) };
        if let Ok(mut messages) = log.messages.lock() {
            messages.push(text);
        }
    }
    vk::FALSE
}

struct BufferEntry {
    buffer: vk::Buffer,
    allocation: Allocation,
}

struct State {
    allocator: ManuallyDrop<Allocator>,
    buffers: Vec<Option<BufferEntry>>,
    free_slots: Vec<u32>,
    modules: HashMap<KernelRef, vk::ShaderModule>,
    pipelines: HashMap<KernelRef, vk::Pipeline>,
    pipeline_cache: vk::PipelineCache,
    cache_dirty: bool,
    command_pool: vk::CommandPool,
    command_buffer: vk::CommandBuffer,
    fence: vk::Fence,
    query_pool: vk::QueryPool,
    query_capacity: u32,
    /// The address table: `MAX_SLOTS` device addresses, 0 for a free slot.
    table: vk::Buffer,
    table_allocation: Option<Allocation>,
    /// Table entries written on the host and not yet copied to the device (the next submission
    /// records them first), and whether the table still needs its initial clear.
    pending_addresses: Vec<(u32, u64)>,
    table_cleared: bool,
}

struct Shared {
    device: ash::Device,
    queue: vk::Queue,
    description: String,
    statistics: Option<ash::khr::pipeline_executable_properties::Device>,
    is_cpu: bool,
    /// The matrix paths the device can take, and the one the ops take.
    matrix_paths: Vec<MatrixPath>,
    matrix_path: MatrixPath,
    max_buffer_bytes: u64,
    /// `maxComputeSharedMemorySize`: kernels that declare more are refused.
    max_workgroup_memory: u64,
    timestamp_period_ns: f64,
    timestamp_mask: u64,
    set_layout: vk::DescriptorSetLayout,
    pipeline_layout: vk::PipelineLayout,
    descriptor_pool: vk::DescriptorPool,
    descriptor_set: vk::DescriptorSet,
    cache_key: CacheKey,
    cache_path: Option<PathBuf>,
    state: Mutex<State>,
    /// Declared last: dropped after `Drop for Shared` has destroyed the device.
    base: InstanceParts,
}

// SAFETY: every Vulkan handle in Shared is used under the `state` mutex or is immutable after
// creation; the raw ValidationLog pointer is only read by the layer's callback and freed in Drop.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// The Vulkan backend. Cheap to share: clones of the inner handle keep the device alive.
pub struct VulkanGpu {
    shared: Arc<Shared>,
}

struct Candidate {
    physical: vk::PhysicalDevice,
    report: DeviceReport,
    device_type: vk::PhysicalDeviceType,
    queue_family: Option<u32>,
}

fn device_kind(kind: vk::PhysicalDeviceType) -> &'static str {
    match kind {
        vk::PhysicalDeviceType::DISCRETE_GPU => "discrete GPU",
        vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated GPU",
        vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual GPU",
        vk::PhysicalDeviceType::CPU => "CPU",
        _ => "other",
    }
}

fn version_string(v: u32) -> String {
    format!("{}.{}.{}", vk::api_version_major(v), vk::api_version_minor(v), vk::api_version_patch(v))
}

fn preference(kind: vk::PhysicalDeviceType) -> u32 {
    match kind {
        vk::PhysicalDeviceType::DISCRETE_GPU => 0,
        vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
        vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
        vk::PhysicalDeviceType::CPU => 3,
        _ => 4,
    }
}

fn c_chars(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn load_entry() -> Result<ash::Entry> {
    // SAFETY: loading the system Vulkan loader; failure is reported, not a crash.
    unsafe { ash::Entry::load() }.map_err(|e| Error::DeviceUnavailable {
        backend: "vulkan",
        reason: format!("cannot load the Vulkan loader (libvulkan.so.1): {e}"),
    })
}

/// The instance and what hangs off it; dropping it destroys them (after `Shared`'s device).
struct InstanceParts {
    /// Keeps the Vulkan loader library loaded while the instance lives.
    _entry: ash::Entry,
    instance: ash::Instance,
    debug: Option<(ash::ext::debug_utils::Instance, vk::DebugUtilsMessengerEXT)>,
    validation: Option<*const ValidationLog>,
}

fn create_instance(validation: bool) -> Result<InstanceParts> {
    let entry = load_entry()?;
    // SAFETY: plain queries on a loaded entry.
    let api = unsafe { entry.try_enumerate_instance_version() }.ok().flatten().unwrap_or(vk::API_VERSION_1_0);
    if api < vk::API_VERSION_1_2 {
        return Err(Error::DeviceUnavailable {
            backend: "vulkan",
            reason: format!("the Vulkan loader supports API {}, 1.2 or newer is required", version_string(api)),
        });
    }
    let available: Vec<String> = unsafe { entry.enumerate_instance_extension_properties(None) }
        .map_err(vk_error("vkEnumerateInstanceExtensionProperties"))?
        .iter()
        .map(|e| c_chars(&e.extension_name))
        .collect();
    let mut extensions: Vec<*const std::ffi::c_char> = Vec::new();
    let mut flags = vk::InstanceCreateFlags::empty();
    if available.iter().any(|e| e == "VK_KHR_portability_enumeration") {
        extensions.push(ash::khr::portability_enumeration::NAME.as_ptr());
        flags |= vk::InstanceCreateFlags::ENUMERATE_PORTABILITY_KHR;
    }
    let mut layers: Vec<*const std::ffi::c_char> = Vec::new();
    if validation {
        let layer_names: Vec<String> = unsafe { entry.enumerate_instance_layer_properties() }
            .map_err(vk_error("vkEnumerateInstanceLayerProperties"))?
            .iter()
            .map(|l| c_chars(&l.layer_name))
            .collect();
        if !layer_names.iter().any(|l| l == "VK_LAYER_KHRONOS_validation") {
            return Err(Error::DeviceUnavailable {
                backend: "vulkan",
                reason: format!(
                    "{VALIDATION_ENV} asks for VK_LAYER_KHRONOS_validation, which is not installed \
                     (Debian: apt-get install vulkan-validationlayers)"
                ),
            });
        }
        layers.push(VALIDATION_LAYER.as_ptr());
        extensions.push(ash::ext::debug_utils::NAME.as_ptr());
    }
    let app_name = c"mamba-kernels";
    let app = vk::ApplicationInfo::default()
        .application_name(app_name)
        .engine_name(app_name)
        .api_version(if api >= vk::API_VERSION_1_3 { vk::API_VERSION_1_3 } else { vk::API_VERSION_1_2 });
    let enabled_features = [vk::ValidationFeatureEnableEXT::SYNCHRONIZATION_VALIDATION];
    let mut validation_features = vk::ValidationFeaturesEXT::default().enabled_validation_features(&enabled_features);
    let mut info = vk::InstanceCreateInfo::default()
        .application_info(&app)
        .enabled_extension_names(&extensions)
        .enabled_layer_names(&layers)
        .flags(flags);
    if validation {
        info = info.push_next(&mut validation_features);
    }
    // SAFETY: every pointer in `info` outlives the call.
    let instance = unsafe { entry.create_instance(&info, None) }.map_err(|result| match result {
        vk::Result::ERROR_INCOMPATIBLE_DRIVER => Error::DeviceUnavailable {
            backend: "vulkan",
            reason: "no Vulkan driver found (ERROR_INCOMPATIBLE_DRIVER); on a machine without a GPU install \
                     Mesa's lavapipe (mesa-vulkan-drivers >= 25)"
                .into(),
        },
        other => Error::Vulkan { call: "vkCreateInstance", result: format!("{other:?}") },
    })?;
    let (debug, log_ptr) = if validation {
        let log = Box::into_raw(Box::new(ValidationLog::default())) as *const ValidationLog;
        let loader = ash::ext::debug_utils::Instance::new(&entry, &instance);
        let messenger_info = vk::DebugUtilsMessengerCreateInfoEXT::default()
            .message_severity(
                vk::DebugUtilsMessageSeverityFlagsEXT::WARNING | vk::DebugUtilsMessageSeverityFlagsEXT::ERROR,
            )
            .message_type(
                vk::DebugUtilsMessageTypeFlagsEXT::GENERAL
                    | vk::DebugUtilsMessageTypeFlagsEXT::VALIDATION
                    | vk::DebugUtilsMessageTypeFlagsEXT::PERFORMANCE,
            )
            .pfn_user_callback(Some(debug_callback))
            .user_data(log as *mut c_void);
        let messenger = unsafe { loader.create_debug_utils_messenger(&messenger_info, None) }
            .map_err(vk_error("vkCreateDebugUtilsMessengerEXT"))?;
        (Some((loader, messenger)), Some(log))
    } else {
        (None, None)
    };
    Ok(InstanceParts { _entry: entry, instance, debug, validation: log_ptr })
}

fn required_features_missing(
    features: &vk::PhysicalDeviceFeatures,
    f12: &vk::PhysicalDeviceVulkan12Features<'_>,
) -> Vec<String> {
    let mut missing = Vec::new();
    let checks = [(f12.buffer_device_address, "bufferDeviceAddress"), (features.shader_int64, "shaderInt64")];
    for (value, name) in checks {
        if value == vk::FALSE {
            missing.push(name.to_string());
        }
    }
    missing
}

fn survey(entry: &ash::Entry, instance: &ash::Instance) -> Result<Vec<Candidate>> {
    // SAFETY: queries on a valid instance.
    let physicals = unsafe { instance.enumerate_physical_devices() }.map_err(vk_error("vkEnumeratePhysicalDevices"))?;
    let mut candidates = Vec::new();
    for (index, &physical) in physicals.iter().enumerate() {
        let mut driver = vk::PhysicalDeviceDriverProperties::default();
        let mut properties2 = vk::PhysicalDeviceProperties2::default().push_next(&mut driver);
        unsafe { instance.get_physical_device_properties2(physical, &mut properties2) };
        let properties = properties2.properties;
        let driver_text = format!("{} {}", c_chars(&driver.driver_name), c_chars(&driver.driver_info));
        let mut missing = Vec::new();
        if properties.api_version < vk::API_VERSION_1_2 {
            missing.push(format!("Vulkan 1.2 (device offers {})", version_string(properties.api_version)));
        } else {
            let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
            let mut features2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut f12);
            unsafe { instance.get_physical_device_features2(physical, &mut features2) };
            let core = features2.features;
            missing.extend(required_features_missing(&core, &f12));
        }
        let families = unsafe { instance.get_physical_device_queue_family_properties(physical) };
        let queue_family = families
            .iter()
            .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE) && f.timestamp_valid_bits > 0)
            .or_else(|| families.iter().position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE)))
            .map(|i| i as u32);
        match queue_family {
            None => missing.push("a compute queue".into()),
            Some(family) if families[family as usize].timestamp_valid_bits == 0 => {
                missing.push("timestamps on the compute queue".into())
            }
            Some(_) => {}
        }
        if properties.limits.max_push_constants_size < MAX_PUSH_CONSTANT_BYTES as u32 {
            missing.push(format!("{MAX_PUSH_CONSTANT_BYTES} bytes of push constants"));
        }
        let extensions: Vec<String> = unsafe { instance.enumerate_device_extension_properties(physical) }
            .map_err(vk_error("vkEnumerateDeviceExtensionProperties"))?
            .iter()
            .map(|e| c_chars(&e.extension_name))
            .collect();
        let tensor_cores = tensor_cores::survey(entry, instance, physical, properties.api_version, &extensions);
        candidates.push(Candidate {
            physical,
            device_type: properties.device_type,
            queue_family,
            report: DeviceReport {
                index,
                name: c_chars(&properties.device_name),
                kind: device_kind(properties.device_type).into(),
                api_version: version_string(properties.api_version),
                driver: driver_text.trim().to_string(),
                missing,
                tensor_cores,
            },
        });
    }
    Ok(candidates)
}

/// Every Vulkan device on this machine, with what each lacks.
pub fn list_devices() -> Result<Vec<DeviceReport>> {
    let parts = create_instance(false)?;
    survey(&parts._entry, &parts.instance).map(|c| c.into_iter().map(|c| c.report).collect())
}

fn choose(candidates: &[Candidate]) -> Result<usize> {
    if candidates.is_empty() {
        return Err(Error::DeviceUnavailable {
            backend: "vulkan",
            reason: "the Vulkan loader found no devices".into(),
        });
    }
    let describe = |c: &Candidate| -> String {
        let r = &c.report;
        if r.missing.is_empty() {
            format!("{}: {} ({})", r.index, r.name, r.kind)
        } else {
            format!("{}: {} ({}) lacks {}", r.index, r.name, r.kind, r.missing.join(", "))
        }
    };
    if let Ok(wanted) = std::env::var(DEVICE_ENV) {
        let wanted = wanted.trim().to_string();
        let found = match wanted.parse::<usize>() {
            Ok(index) => candidates.iter().position(|c| c.report.index == index),
            Err(_) => {
                let needle = wanted.to_lowercase();
                candidates.iter().position(|c| c.report.name.to_lowercase().contains(&needle))
            }
        };
        let index = found.ok_or_else(|| Error::DeviceUnavailable {
            backend: "vulkan",
            reason: format!(
                "{DEVICE_ENV}={wanted:?} matches no device; devices: {}",
                candidates.iter().map(describe).collect::<Vec<_>>().join("; ")
            ),
        })?;
        if !candidates[index].report.missing.is_empty() {
            return Err(Error::DeviceUnavailable { backend: "vulkan", reason: describe(&candidates[index]) });
        }
        return Ok(index);
    }
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.report.missing.is_empty())
        .min_by_key(|(i, c)| (preference(c.device_type), *i))
        .map(|(i, _)| i)
        .ok_or_else(|| Error::DeviceUnavailable {
            backend: "vulkan",
            reason: format!(
                "no device has the required features; {}",
                candidates.iter().map(describe).collect::<Vec<_>>().join("; ")
            ),
        })
}

impl VulkanGpu {
    /// Opens the device `MAMBA_VK_DEVICE` names, else the first discrete GPU, else an integrated
    /// one, else a CPU device such as lavapipe. Validation follows `MAMBA_VK_VALIDATION`.
    pub fn new() -> Result<Self> {
        let validation = std::env::var(VALIDATION_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        Self::with_validation(validation)
    }

    /// As [`VulkanGpu::new`], with validation chosen by the caller.
    pub fn with_validation(validation: bool) -> Result<Self> {
        // On an error the instance is destroyed by dropping `InstanceParts`.
        Ok(VulkanGpu { shared: Arc::new(open_device(create_instance(validation)?)?) })
    }

    /// Validation-layer warnings and errors seen so far (always empty without validation).
    pub fn validation_messages(&self) -> Vec<String> {
        match self.shared.base.validation {
            // SAFETY: the log lives until Shared drops, which cannot happen while &self exists.
            Some(log) => unsafe { &*log }.messages.lock().map(|m| m.clone()).unwrap_or_default(),
            None => Vec::new(),
        }
    }

    /// Whether the validation layer is on.
    pub fn validation_enabled(&self) -> bool {
        self.shared.base.validation.is_some()
    }

    /// Where the pipeline cache is persisted, if anywhere.
    pub fn pipeline_cache_path(&self) -> Option<PathBuf> {
        self.shared.cache_path.clone()
    }
}

/// Chooses the physical device, creates the logical device, the bindless layout, the allocator,
/// the command objects and the pipeline cache.
fn open_device(parts: InstanceParts) -> Result<Shared> {
    let instance = &parts.instance;
    let candidates = survey(&parts._entry, instance)?;
    let chosen = &candidates[choose(&candidates)?];
    let physical = chosen.physical;
    let queue_family = chosen
        .queue_family
        .ok_or_else(|| Error::DeviceUnavailable { backend: "vulkan", reason: "no compute queue".into() })?;
    // SAFETY: queries and object creation on a valid instance / device; all create-info
    // pointers outlive the calls.
    let properties = unsafe { instance.get_physical_device_properties(physical) };
    let families = unsafe { instance.get_physical_device_queue_family_properties(physical) };
    // Kernels index tensors with 32-bit element offsets and the CUDA backend shares that limit;
    // the device's own buffer and allocation limits apply as well.
    let mut maintenance3 = vk::PhysicalDeviceMaintenance3Properties::default();
    let mut maintenance4 = vk::PhysicalDeviceMaintenance4Properties::default();
    let mut properties2 = vk::PhysicalDeviceProperties2::default().push_next(&mut maintenance3);
    if properties.api_version >= vk::API_VERSION_1_3 {
        properties2 = properties2.push_next(&mut maintenance4);
    }
    unsafe { instance.get_physical_device_properties2(physical, &mut properties2) };
    let mut max_buffer_bytes = (u64::from(u32::MAX) - 15).min(maintenance3.max_memory_allocation_size);
    if properties.api_version >= vk::API_VERSION_1_3 {
        max_buffer_bytes = max_buffer_bytes.min(maintenance4.max_buffer_size);
    }

    let device_extensions: Vec<String> = unsafe { instance.enumerate_device_extension_properties(physical) }
        .map_err(vk_error("vkEnumerateDeviceExtensionProperties"))?
        .iter()
        .map(|e| c_chars(&e.extension_name))
        .collect();
    let mut extensions: Vec<*const std::ffi::c_char> = Vec::new();
    if device_extensions.iter().any(|e| e == "VK_KHR_portability_subset") {
        extensions.push(c"VK_KHR_portability_subset".as_ptr());
    }
    let pipeline_stats = std::env::var(PIPELINE_STATS_ENV).is_ok_and(|v| v == "1")
        && device_extensions.iter().any(|e| e == "VK_KHR_pipeline_executable_properties");
    if pipeline_stats {
        extensions.push(ash::khr::pipeline_executable_properties::NAME.as_ptr());
    }
    let mut executable_properties =
        vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default().pipeline_executable_info(true);
    let priorities = [1.0f32];
    let queue_info =
        [vk::DeviceQueueCreateInfo::default().queue_family_index(queue_family).queue_priorities(&priorities)];
    let has_tensor_cores = chosen.report.tensor_cores.is_ok();
    let mut matrix_paths = vec![MatrixPath::Simt, MatrixPath::Emulated];
    if has_tensor_cores {
        matrix_paths.push(MatrixPath::TensorCores);
    }
    let matrix_path = MatrixPath::default_for(&matrix_paths, &chosen.report.name)?;
    let mut f12 = vk::PhysicalDeviceVulkan12Features::default()
        .buffer_device_address(true)
        .vulkan_memory_model(has_tensor_cores)
        .vulkan_memory_model_device_scope(has_tensor_cores);
    let mut cooperative = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
    let mut bfloat16 = tensor_cores::ShaderBfloat16Features {
        shader_bfloat16_type: vk::TRUE,
        shader_bfloat16_cooperative_matrix: vk::TRUE,
        ..Default::default()
    };
    if has_tensor_cores {
        extensions.push(ash::khr::cooperative_matrix::NAME.as_ptr());
        extensions.push(c"VK_KHR_shader_bfloat16".as_ptr());
    }
    let core_features = vk::PhysicalDeviceFeatures::default().shader_int64(true);
    let mut device_info = vk::DeviceCreateInfo::default()
        .queue_create_infos(&queue_info)
        .enabled_extension_names(&extensions)
        .enabled_features(&core_features)
        .push_next(&mut f12);
    if pipeline_stats {
        device_info = device_info.push_next(&mut executable_properties);
    }
    if has_tensor_cores {
        device_info = device_info.push_next(&mut cooperative).push_next(&mut bfloat16);
    }
    let device = unsafe { instance.create_device(physical, &device_info, None) }.map_err(vk_error("vkCreateDevice"))?;
    let build = || -> Result<(vk::DescriptorSetLayout, vk::PipelineLayout, vk::DescriptorPool, vk::DescriptorSet)> {
        // One binding: the address table, read-only in every kernel.
        let bindings = [vk::DescriptorSetLayoutBinding::default()
            .binding(0)
            .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
            .descriptor_count(1)
            .stage_flags(vk::ShaderStageFlags::COMPUTE)];
        let layout_info = vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings);
        let set_layout = unsafe { device.create_descriptor_set_layout(&layout_info, None) }
            .map_err(vk_error("vkCreateDescriptorSetLayout"))?;
        let ranges = [vk::PushConstantRange::default()
            .stage_flags(vk::ShaderStageFlags::COMPUTE)
            .offset(0)
            .size(MAX_PUSH_CONSTANT_BYTES as u32)];
        let set_layouts = [set_layout];
        let pipeline_layout_info =
            vk::PipelineLayoutCreateInfo::default().set_layouts(&set_layouts).push_constant_ranges(&ranges);
        let pipeline_layout = unsafe { device.create_pipeline_layout(&pipeline_layout_info, None) }
            .map_err(vk_error("vkCreatePipelineLayout"))?;
        let pool_sizes = [vk::DescriptorPoolSize::default().ty(vk::DescriptorType::STORAGE_BUFFER).descriptor_count(1)];
        let pool_info = vk::DescriptorPoolCreateInfo::default().pool_sizes(&pool_sizes).max_sets(1);
        let descriptor_pool =
            unsafe { device.create_descriptor_pool(&pool_info, None) }.map_err(vk_error("vkCreateDescriptorPool"))?;
        let allocate =
            vk::DescriptorSetAllocateInfo::default().descriptor_pool(descriptor_pool).set_layouts(&set_layouts);
        let descriptor_set =
            unsafe { device.allocate_descriptor_sets(&allocate) }.map_err(vk_error("vkAllocateDescriptorSets"))?[0];
        Ok((set_layout, pipeline_layout, descriptor_pool, descriptor_set))
    };
    let (set_layout, pipeline_layout, descriptor_pool, descriptor_set) = match build() {
        Ok(v) => v,
        Err(e) => {
            unsafe { device.destroy_device(None) };
            return Err(e);
        }
    };
    let allocator = Allocator::new(&AllocatorCreateDesc {
        instance: instance.clone(),
        device: device.clone(),
        physical_device: physical,
        debug_settings: Default::default(),
        buffer_device_address: true,
        allocation_sizes: Default::default(),
    })
    .map_err(|e| Error::Allocation { bytes: 0, reason: format!("creating the allocator: {e}") })?;
    let queue = unsafe { device.get_device_queue(queue_family, 0) };
    let statistics = pipeline_stats.then(|| ash::khr::pipeline_executable_properties::Device::new(instance, &device));
    let pool_info = vk::CommandPoolCreateInfo::default()
        .queue_family_index(queue_family)
        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
    let command_pool =
        unsafe { device.create_command_pool(&pool_info, None) }.map_err(vk_error("vkCreateCommandPool"))?;
    let command_buffer = unsafe {
        device.allocate_command_buffers(
            &vk::CommandBufferAllocateInfo::default()
                .command_pool(command_pool)
                .level(vk::CommandBufferLevel::PRIMARY)
                .command_buffer_count(1),
        )
    }
    .map_err(vk_error("vkAllocateCommandBuffers"))?[0];
    let fence =
        unsafe { device.create_fence(&vk::FenceCreateInfo::default(), None) }.map_err(vk_error("vkCreateFence"))?;

    let mut driver = vk::PhysicalDeviceDriverProperties::default();
    let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut driver);
    unsafe { instance.get_physical_device_properties2(physical, &mut p2) };
    let cache_key = CacheKey {
        vendor_id: properties.vendor_id,
        device_id: properties.device_id,
        driver_version: properties.driver_version,
        pipeline_cache_uuid: properties.pipeline_cache_uuid,
        shader_set_hash: SHADER_SET_HASH,
    };
    let cache_path = pipeline_cache::cache_path(&cache_key);
    let initial = cache_path.as_deref().and_then(|p| pipeline_cache::load(p, &cache_key)).unwrap_or_default();
    let pipeline_cache =
        unsafe { device.create_pipeline_cache(&vk::PipelineCacheCreateInfo::default().initial_data(&initial), None) }
            .or_else(|_| unsafe { device.create_pipeline_cache(&vk::PipelineCacheCreateInfo::default(), None) })
            .map_err(vk_error("vkCreatePipelineCache"))?;

    let description = format!(
        "{} ({}, Vulkan {}, {})",
        chosen.report.name,
        chosen.report.kind,
        version_string(properties.api_version),
        chosen.report.driver
    );
    let is_cpu = chosen.device_type == vk::PhysicalDeviceType::CPU;

    let timestamp_bits = families[queue_family as usize].timestamp_valid_bits;
    let timestamp_mask = if timestamp_bits >= 64 { u64::MAX } else { (1u64 << timestamp_bits) - 1 };
    let timestamp_period_ns = f64::from(properties.limits.timestamp_period);

    let mut state = State {
        allocator: ManuallyDrop::new(allocator),
        buffers: Vec::new(),
        free_slots: Vec::new(),
        modules: HashMap::new(),
        pipelines: HashMap::new(),
        pipeline_cache,
        cache_dirty: false,
        command_pool,
        command_buffer,
        fence,
        query_pool: vk::QueryPool::null(),
        query_capacity: 0,
        table: vk::Buffer::null(),
        table_allocation: None,
        pending_addresses: Vec::new(),
        table_cleared: false,
    };
    let table_bytes = u64::from(MAX_SLOTS) * 8;
    let (table, table_allocation) =
        create_buffer(&device, &mut state.allocator, table_bytes, MemoryLocation::GpuOnly, "address table")?;
    state.table = table;
    state.table_allocation = Some(table_allocation);
    let table_info = [vk::DescriptorBufferInfo::default().buffer(table).offset(0).range(table_bytes)];
    let write = vk::WriteDescriptorSet::default()
        .dst_set(descriptor_set)
        .dst_binding(0)
        .dst_array_element(0)
        .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
        .buffer_info(&table_info);
    // SAFETY: a fresh set that no command buffer uses yet.
    unsafe { device.update_descriptor_sets(&[write], &[]) };
    Ok(Shared {
        device,
        queue,
        description,
        statistics,
        is_cpu,
        matrix_paths,
        matrix_path,
        max_buffer_bytes,
        max_workgroup_memory: u64::from(properties.limits.max_compute_shared_memory_size),
        timestamp_period_ns,
        timestamp_mask,
        set_layout,
        pipeline_layout,
        descriptor_pool,
        descriptor_set,
        cache_key,
        cache_path,
        state: Mutex::new(state),
        base: parts,
    })
}

impl Drop for InstanceParts {
    fn drop(&mut self) {
        // SAFETY: every object made from this instance (device, surfaces: none) is gone by now;
        // the validation log is freed after the messenger that writes to it.
        unsafe {
            if let Some((loader, messenger)) = &self.debug {
                loader.destroy_debug_utils_messenger(*messenger, None);
            }
            self.instance.destroy_instance(None);
            if let Some(log) = self.validation.take() {
                drop(Box::from_raw(log as *mut ValidationLog));
            }
        }
    }
}

fn create_buffer(
    device: &ash::Device,
    allocator: &mut Allocator,
    bytes: u64,
    location: MemoryLocation,
    name: &str,
) -> Result<(vk::Buffer, Allocation)> {
    let info = vk::BufferCreateInfo::default()
        .size(bytes)
        .usage(
            vk::BufferUsageFlags::STORAGE_BUFFER
                | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS
                | vk::BufferUsageFlags::TRANSFER_SRC
                | vk::BufferUsageFlags::TRANSFER_DST,
        )
        .sharing_mode(vk::SharingMode::EXCLUSIVE);
    // SAFETY: valid device; the buffer is bound to memory below before any use.
    let buffer = unsafe { device.create_buffer(&info, None) }.map_err(vk_error("vkCreateBuffer"))?;
    let requirements = unsafe { device.get_buffer_memory_requirements(buffer) };
    let allocation = match allocator.allocate(&AllocationCreateDesc {
        name,
        requirements,
        location,
        linear: true,
        allocation_scheme: AllocationScheme::GpuAllocatorManaged,
    }) {
        Ok(a) => a,
        Err(e) => {
            unsafe { device.destroy_buffer(buffer, None) };
            return Err(Error::Allocation { bytes, reason: e.to_string() });
        }
    };
    if let Err(e) = unsafe { device.bind_buffer_memory(buffer, allocation.memory(), allocation.offset()) } {
        let _ = allocator.free(allocation);
        unsafe { device.destroy_buffer(buffer, None) };
        return Err(vk_error("vkBindBufferMemory")(e));
    }
    Ok((buffer, allocation))
}

/// Whether the host can read and write this allocation directly.
fn host_coherent(allocation: &Allocation) -> bool {
    allocation.mapped_ptr().is_some() && allocation.memory_properties().contains(vk::MemoryPropertyFlags::HOST_COHERENT)
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held (only possible in a test) leaves the state usable.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records the address-table writes made since the last submission (and the table's first
    /// clear) at the head of a command buffer, with the barrier that makes them visible to kernels.
    fn record_table_updates(&self, state: &mut State, cb: vk::CommandBuffer) {
        if state.table_cleared && state.pending_addresses.is_empty() {
            return;
        }
        // SAFETY: recording state; the table is idle (every submission is waited for).
        unsafe {
            if !state.table_cleared {
                self.device.cmd_fill_buffer(cb, state.table, 0, vk::WHOLE_SIZE, 0);
                state.table_cleared = true;
                let transfer = (vk::PipelineStageFlags::TRANSFER, vk::AccessFlags::TRANSFER_WRITE);
                memory_barrier(&self.device, cb, transfer, transfer);
            }
            // A later write to a slot wins (the map keeps the last); runs of neighbouring slots go
            // in one update of at most 64 KiB, vkCmdUpdateBuffer's limit.
            const MAX_UPDATE_WORDS: usize = 65536 / 8;
            let entries: Vec<(u32, u64)> =
                state.pending_addresses.drain(..).collect::<std::collections::BTreeMap<_, _>>().into_iter().collect();
            let mut i = 0;
            while i < entries.len() {
                let mut j = i + 1;
                while j < entries.len() && entries[j].0 == entries[j - 1].0 + 1 && j - i < MAX_UPDATE_WORDS {
                    j += 1;
                }
                let words: Vec<u64> = entries[i..j].iter().map(|&(_, a)| a).collect();
                self.device.cmd_update_buffer(
                    cb,
                    state.table,
                    u64::from(entries[i].0) * 8,
                    bytemuck::cast_slice(&words),
                );
                i = j;
            }
            memory_barrier(
                &self.device,
                cb,
                (vk::PipelineStageFlags::TRANSFER, vk::AccessFlags::TRANSFER_WRITE),
                (vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_READ),
            );
        }
    }

    fn pipeline(&self, state: &mut State, kernel: KernelRef) -> Result<vk::Pipeline> {
        if let Some(&pipeline) = state.pipelines.get(&kernel) {
            return Ok(pipeline);
        }
        let file =
            KERNEL_FILES.get(kernel.file).ok_or_else(|| Error::Dispatch(format!("no kernel file {}", kernel.file)))?;
        let entry = file
            .entry_points
            .get(kernel.entry)
            .ok_or_else(|| Error::Dispatch(format!("{} has no entry {}", file.name, kernel.entry)))?;
        let words = entry.spirv_words();
        let workgroup_bytes = crate::kernels::workgroup_memory_bytes(&words);
        if workgroup_bytes > self.max_workgroup_memory {
            return Err(Error::WorkgroupMemory {
                kernel: kernel.label(),
                bytes: workgroup_bytes,
                limit: self.max_workgroup_memory,
                device: self.description.clone(),
            });
        }
        let module = match state.modules.get(&kernel) {
            Some(&m) => m,
            None => {
                let info = vk::ShaderModuleCreateInfo::default().code(&words);
                // SAFETY: build.rs produced this SPIR-V with slangc.
                let module = unsafe { self.device.create_shader_module(&info, None) }
                    .map_err(vk_error("vkCreateShaderModule"))?;
                state.modules.insert(kernel, module);
                module
            }
        };
        let name = CString::new(entry.name).map_err(|_| Error::Dispatch(format!("bad entry name {}", entry.name)))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(&name);
        let ir_dir = std::env::var_os(PIPELINE_IR_ENV).map(std::path::PathBuf::from);
        let flags = match (&self.statistics, &ir_dir) {
            (None, _) => vk::PipelineCreateFlags::empty(),
            (Some(_), None) => vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR,
            (Some(_), Some(_)) => {
                vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR
                    | vk::PipelineCreateFlags::CAPTURE_INTERNAL_REPRESENTATIONS_KHR
            }
        };
        let info = [vk::ComputePipelineCreateInfo::default().stage(stage).layout(self.pipeline_layout).flags(flags)];
        let pipeline = unsafe { self.device.create_compute_pipelines(state.pipeline_cache, &info, None) }
            .map_err(|(_, e)| vk_error("vkCreateComputePipelines")(e))?[0];
        if let Some(loader) = &self.statistics {
            eprintln!("[pipeline stats] {}: {}", kernel.label(), pipeline_statistics(loader, pipeline));
            if let Some(dir) = &ir_dir {
                dump_internal_representations(&self.device, loader, pipeline, &kernel.label(), dir);
            }
        }
        if let Some(dir) = std::env::var_os(PIPELINE_BINARY_ENV) {
            self.dump_pipeline_binary(&info, &kernel.label(), std::path::Path::new(&dir));
        }
        state.pipelines.insert(kernel, pipeline);
        state.cache_dirty = true;
        Ok(pipeline)
    }

    /// Builds the pipeline again into an empty cache and writes that cache's data to `dir`.
    fn dump_pipeline_binary(&self, info: &[vk::ComputePipelineCreateInfo<'_>], label: &str, dir: &std::path::Path) {
        let _ = std::fs::create_dir_all(dir);
        // SAFETY: a fresh cache and pipeline, destroyed before returning; `info` is valid.
        unsafe {
            let Ok(cache) = self.device.create_pipeline_cache(&vk::PipelineCacheCreateInfo::default(), None) else {
                return;
            };
            if let Ok(pipelines) = self.device.create_compute_pipelines(cache, info, None) {
                if let Ok(blob) = self.device.get_pipeline_cache_data(cache) {
                    let _ = std::fs::write(dir.join(format!("{}.bin", label.replace("::", "."))), blob);
                }
                for p in pipelines {
                    self.device.destroy_pipeline(p, None);
                }
            }
            self.device.destroy_pipeline_cache(cache, None);
        }
    }

    /// Writes the pipeline cache back to disk if new pipelines were made. Failures are ignored:
    /// a read-only cache directory must not stop the computation.
    fn save_cache(&self, state: &mut State) {
        if !state.cache_dirty {
            return;
        }
        state.cache_dirty = false;
        let Some(path) = &self.cache_path else { return };
        // SAFETY: valid cache handle.
        if let Ok(blob) = unsafe { self.device.get_pipeline_cache_data(state.pipeline_cache) } {
            let _ = pipeline_cache::store(path, &self.cache_key, &blob);
        }
    }

    fn ensure_queries(&self, state: &mut State, count: u32) -> Result<()> {
        if state.query_capacity >= count {
            return Ok(());
        }
        // SAFETY: no pending work uses the old pool (all submissions are waited for).
        unsafe {
            if state.query_pool != vk::QueryPool::null() {
                self.device.destroy_query_pool(state.query_pool, None);
            }
            let info = vk::QueryPoolCreateInfo::default().query_type(vk::QueryType::TIMESTAMP).query_count(count);
            state.query_pool = self.device.create_query_pool(&info, None).map_err(vk_error("vkCreateQueryPool"))?;
        }
        state.query_capacity = count;
        Ok(())
    }

    /// Records with `record`, submits, waits.
    fn submit(&self, state: &mut State, record: impl FnOnce(&ash::Device, vk::CommandBuffer)) -> Result<()> {
        let cb = state.command_buffer;
        // SAFETY: the command buffer is idle (every submission is waited for) and recorded here only.
        unsafe {
            self.device
                .reset_command_buffer(cb, vk::CommandBufferResetFlags::empty())
                .map_err(vk_error("vkResetCommandBuffer"))?;
            self.device
                .begin_command_buffer(
                    cb,
                    &vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
                )
                .map_err(vk_error("vkBeginCommandBuffer"))?;
            self.record_table_updates(state, cb);
            record(&self.device, cb);
            // Make every device write visible to the host before the fence signals.
            memory_barrier(
                &self.device,
                cb,
                (
                    vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
                    vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE,
                ),
                (vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_READ),
            );
            self.device.end_command_buffer(cb).map_err(vk_error("vkEndCommandBuffer"))?;
            let buffers = [cb];
            let submit = [vk::SubmitInfo::default().command_buffers(&buffers)];
            self.device.queue_submit(self.queue, &submit, state.fence).map_err(vk_error("vkQueueSubmit"))?;
            let waited = self.device.wait_for_fences(&[state.fence], true, u64::MAX);
            self.device.reset_fences(&[state.fence]).map_err(vk_error("vkResetFences"))?;
            waited.map_err(vk_error("vkWaitForFences"))?;
        }
        Ok(())
    }

    fn check_buffer<'a>(&self, state: &'a State, buffer: &GpuBuffer) -> Result<&'a BufferEntry> {
        state
            .buffers
            .get(buffer.slot() as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Dispatch(format!("buffer slot {} is not a live Vulkan buffer", buffer.slot())))
    }

    /// Records the dispatches in order with a full compute barrier between neighbours, except
    /// before one marked `alongside_previous`.
    fn record_dispatches(
        &self,
        device: &ash::Device,
        cb: vk::CommandBuffer,
        pipelines: &[vk::Pipeline],
        dispatches: &[Dispatch],
    ) {
        // SAFETY: recording into a command buffer in the recording state with valid handles.
        unsafe {
            device.cmd_bind_descriptor_sets(
                cb,
                vk::PipelineBindPoint::COMPUTE,
                self.pipeline_layout,
                0,
                &[self.descriptor_set],
                &[],
            );
            let mut bound = vk::Pipeline::null();
            for (i, dispatch) in dispatches.iter().enumerate() {
                if i > 0 && !dispatch.overlaps_previous() {
                    compute_barrier(device, cb);
                }
                if pipelines[i] != bound {
                    device.cmd_bind_pipeline(cb, vk::PipelineBindPoint::COMPUTE, pipelines[i]);
                    bound = pipelines[i];
                }
                device.cmd_push_constants(
                    cb,
                    self.pipeline_layout,
                    vk::ShaderStageFlags::COMPUTE,
                    0,
                    dispatch.push_bytes(),
                );
                device.cmd_dispatch(cb, dispatch.groups[0], dispatch.groups[1], dispatch.groups[2]);
            }
        }
    }

    fn pipelines_for(&self, state: &mut State, dispatches: &[Dispatch]) -> Result<Vec<vk::Pipeline>> {
        let pipelines = dispatches.iter().map(|d| self.pipeline(state, d.kernel)).collect::<Result<Vec<_>>>()?;
        self.save_cache(state);
        Ok(pipelines)
    }

    fn read_timestamps(&self, state: &State, count: u32) -> Result<Vec<u64>> {
        let mut stamps = vec![0u64; count as usize];
        // SAFETY: the queries were written by a completed submission.
        unsafe {
            self.device.get_query_pool_results(
                state.query_pool,
                0,
                &mut stamps,
                vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
            )
        }
        .map_err(vk_error("vkGetQueryPoolResults"))?;
        Ok(stamps.into_iter().map(|s| s & self.timestamp_mask).collect())
    }

    fn seconds_between(&self, stamps: &[u64]) -> Vec<f64> {
        stamps.chunks(2).map(|p| p[1].wrapping_sub(p[0]) as f64 * self.timestamp_period_ns * 1e-9).collect()
    }
}

/// The driver's statistics of a pipeline's executables, as `name=value` pairs.
fn pipeline_statistics(loader: &ash::khr::pipeline_executable_properties::Device, pipeline: vk::Pipeline) -> String {
    let info = vk::PipelineInfoKHR::default().pipeline(pipeline);
    // SAFETY: a pipeline created with CAPTURE_STATISTICS on a device with the extension enabled.
    let executables = unsafe { loader.get_pipeline_executable_properties(&info) }.unwrap_or_default();
    let mut parts = Vec::new();
    for index in 0..executables.len() as u32 {
        let executable = vk::PipelineExecutableInfoKHR::default().pipeline(pipeline).executable_index(index);
        for statistic in unsafe { loader.get_pipeline_executable_statistics(&executable) }.unwrap_or_default() {
            // SAFETY: the union member is the one `format` names.
            let value = unsafe {
                match statistic.format {
                    vk::PipelineExecutableStatisticFormatKHR::BOOL32 => statistic.value.b32.to_string(),
                    vk::PipelineExecutableStatisticFormatKHR::INT64 => statistic.value.i64.to_string(),
                    vk::PipelineExecutableStatisticFormatKHR::UINT64 => statistic.value.u64.to_string(),
                    _ => format!("{:.3}", statistic.value.f64),
                }
            };
            parts.push(format!("{}={value}", c_chars(&statistic.name)));
        }
    }
    parts.join(", ")
}

/// Writes the driver's internal representations of a pipeline (text ones) into `dir`.
fn dump_internal_representations(
    device: &ash::Device,
    loader: &ash::khr::pipeline_executable_properties::Device,
    pipeline: vk::Pipeline,
    label: &str,
    dir: &std::path::Path,
) {
    let _ = std::fs::create_dir_all(dir);
    let info = vk::PipelineInfoKHR::default().pipeline(pipeline);
    // SAFETY: the pipeline was created with CAPTURE_INTERNAL_REPRESENTATIONS; each call follows the
    // count / sizes / data protocol of vkGetPipelineExecutableInternalRepresentationsKHR.
    let executables = unsafe { loader.get_pipeline_executable_properties(&info) }.unwrap_or_default();
    let get = loader.fp().get_pipeline_executable_internal_representations_khr;
    for index in 0..executables.len() as u32 {
        let executable = vk::PipelineExecutableInfoKHR::default().pipeline(pipeline).executable_index(index);
        let mut count = 0u32;
        let _ = unsafe { get(device.handle(), &executable, &mut count, std::ptr::null_mut()) };
        let mut items = vec![vk::PipelineExecutableInternalRepresentationKHR::default(); count as usize];
        let _ = unsafe { get(device.handle(), &executable, &mut count, items.as_mut_ptr()) };
        let mut buffers: Vec<Vec<u8>> = items.iter().map(|i| vec![0u8; i.data_size]).collect();
        for (item, buffer) in items.iter_mut().zip(buffers.iter_mut()) {
            item.p_data = buffer.as_mut_ptr() as *mut c_void;
        }
        let _ = unsafe { get(device.handle(), &executable, &mut count, items.as_mut_ptr()) };
        for (item, buffer) in items.iter().zip(&buffers) {
            if item.is_text == vk::TRUE {
                let name = c_chars(&item.name).replace([' ', '/'], "_");
                let file = dir.join(format!("{}.{index}.{name}.txt", label.replace("::", ".")));
                let _ = std::fs::write(file, buffer.split(|&b| b == 0).next().unwrap_or(&[]));
            }
        }
    }
}

/// One global memory barrier: `src` writes in `src_stage` made visible to `dst` in `dst_stage`.
fn memory_barrier(
    device: &ash::Device,
    cb: vk::CommandBuffer,
    (src_stage, src): (vk::PipelineStageFlags, vk::AccessFlags),
    (dst_stage, dst): (vk::PipelineStageFlags, vk::AccessFlags),
) {
    let barrier = [vk::MemoryBarrier::default().src_access_mask(src).dst_access_mask(dst)];
    // SAFETY: recording state.
    unsafe { device.cmd_pipeline_barrier(cb, src_stage, dst_stage, vk::DependencyFlags::empty(), &barrier, &[], &[]) };
}

fn compute_barrier(device: &ash::Device, cb: vk::CommandBuffer) {
    let shader = vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::SHADER_READ;
    let stage = vk::PipelineStageFlags::COMPUTE_SHADER;
    memory_barrier(device, cb, (stage, shader), (stage, shader));
}

impl SlotOwner for Shared {
    fn release(&self, slot: u32) {
        let mut state = self.lock();
        if let Some(entry) = state.buffers.get_mut(slot as usize).and_then(Option::take) {
            // A freed slot reads as a null address, never a destroyed buffer's.
            state.pending_addresses.push((slot, 0));
            // SAFETY: no pending work (submissions are waited for under the lock).
            unsafe { self.device.destroy_buffer(entry.buffer, None) };
            let _ = state.allocator.free(entry.allocation);
            state.free_slots.push(slot);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.save_cache(&mut state);
        // SAFETY: the device is idle and nothing else holds these handles.
        unsafe {
            let _ = self.device.device_wait_idle();
            for (_, pipeline) in state.pipelines.drain() {
                self.device.destroy_pipeline(pipeline, None);
            }
            for (_, module) in state.modules.drain() {
                self.device.destroy_shader_module(module, None);
            }
            self.device.destroy_pipeline_cache(state.pipeline_cache, None);
            let entries: Vec<BufferEntry> = state.buffers.drain(..).flatten().collect();
            for entry in entries {
                self.device.destroy_buffer(entry.buffer, None);
                let _ = state.allocator.free(entry.allocation);
            }
            self.device.destroy_buffer(state.table, None);
            if let Some(allocation) = state.table_allocation.take() {
                let _ = state.allocator.free(allocation);
            }
            if state.query_pool != vk::QueryPool::null() {
                self.device.destroy_query_pool(state.query_pool, None);
            }
            self.device.destroy_fence(state.fence, None);
            self.device.destroy_command_pool(state.command_pool, None);
            ManuallyDrop::drop(&mut state.allocator);
            self.device.destroy_descriptor_pool(self.descriptor_pool, None);
            self.device.destroy_pipeline_layout(self.pipeline_layout, None);
            self.device.destroy_descriptor_set_layout(self.set_layout, None);
            self.device.destroy_device(None);
        }
    }
}

impl Gpu for VulkanGpu {
    fn backend(&self) -> &'static str {
        "vulkan"
    }

    fn device_name(&self) -> String {
        self.shared.description.clone()
    }

    fn max_buffer_bytes(&self) -> u64 {
        self.shared.max_buffer_bytes
    }

    fn is_cpu(&self) -> bool {
        self.shared.is_cpu
    }

    fn matrix_paths(&self) -> Vec<MatrixPath> {
        self.shared.matrix_paths.clone()
    }

    fn matrix_path(&self) -> MatrixPath {
        self.shared.matrix_path
    }

    fn alloc(&self, elements: usize) -> Result<GpuBuffer> {
        let shared = &self.shared;
        let bytes = ((elements.max(1) as u64 * 4).div_ceil(16) * 16).max(16);
        if bytes > shared.max_buffer_bytes {
            return Err(Error::Allocation {
                bytes,
                reason: format!("over the device's buffer limit of {} bytes", shared.max_buffer_bytes),
            });
        }
        let mut state = shared.lock();
        let slot = match state.free_slots.pop() {
            Some(slot) => slot,
            None => {
                let next = state.buffers.len() as u32;
                let capacity = MAX_SLOTS;
                if next >= capacity {
                    return Err(Error::Allocation { bytes, reason: format!("all {capacity} buffer slots are in use") });
                }
                state.buffers.push(None);
                next
            }
        };
        let state = &mut *state;
        let (buffer, allocation) =
            match create_buffer(&shared.device, &mut state.allocator, bytes, MemoryLocation::GpuOnly, "tensor") {
                Ok(v) => v,
                Err(e) => {
                    state.free_slots.push(slot);
                    return Err(e);
                }
            };
        // SAFETY: the buffer was made with SHADER_DEVICE_ADDRESS usage and is bound to memory.
        let address =
            unsafe { shared.device.get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(buffer)) };
        state.pending_addresses.push((slot, address));
        state.buffers[slot as usize] = Some(BufferEntry { buffer, allocation });
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
        let shared = &self.shared;
        let mut guard = shared.lock();
        let state = &mut *guard;
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let entry = shared.check_buffer(state, buffer)?;
        if host_coherent(&entry.allocation) {
            if let Some(ptr) = entry.allocation.mapped_ptr() {
                // SAFETY: the mapping covers the allocation, which is at least `bytes` long; no GPU work is pending.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.as_ptr() as *mut u8, bytes.len()) };
                return Ok(());
            }
        }
        let target = entry.buffer;
        let (staging, mut staging_allocation) = create_buffer(
            &shared.device,
            &mut state.allocator,
            bytes.len().max(16) as u64,
            MemoryLocation::CpuToGpu,
            "upload staging",
        )?;
        let result = match staging_allocation.mapped_slice_mut() {
            Some(slice) => {
                slice[..bytes.len()].copy_from_slice(bytes);
                let size = bytes.len() as u64;
                shared.submit(state, |device, cb| unsafe {
                    device.cmd_copy_buffer(
                        cb,
                        staging,
                        target,
                        &[vk::BufferCopy { src_offset: 0, dst_offset: 0, size }],
                    );
                })
            }
            None => Err(Error::Allocation { bytes: bytes.len() as u64, reason: "staging memory is not mapped".into() }),
        };
        // SAFETY: the copy has completed (submit waits).
        unsafe { shared.device.destroy_buffer(staging, None) };
        let _ = state.allocator.free(staging_allocation);
        result
    }

    fn download(&self, buffer: &GpuBuffer) -> Result<Vec<f32>> {
        let shared = &self.shared;
        let mut guard = shared.lock();
        let state = &mut *guard;
        let entry = shared.check_buffer(state, buffer)?;
        let bytes = buffer.elements() * 4;
        let mut out = vec![0f32; buffer.elements()];
        if host_coherent(&entry.allocation) {
            if let Some(ptr) = entry.allocation.mapped_ptr() {
                // SAFETY: all GPU work is complete and made host-visible by the barrier in submit().
                unsafe { std::ptr::copy_nonoverlapping(ptr.as_ptr() as *const u8, out.as_mut_ptr() as *mut u8, bytes) };
                return Ok(out);
            }
        }
        let source = entry.buffer;
        let (staging, staging_allocation) = create_buffer(
            &shared.device,
            &mut state.allocator,
            bytes.max(16) as u64,
            MemoryLocation::GpuToCpu,
            "download staging",
        )?;
        let size = bytes as u64;
        let result = shared.submit(state, |device, cb| unsafe {
            device.cmd_copy_buffer(cb, source, staging, &[vk::BufferCopy { src_offset: 0, dst_offset: 0, size }]);
        });
        let copied = result.and_then(|_| match staging_allocation.mapped_slice() {
            Some(slice) => {
                bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(&slice[..bytes]);
                Ok(())
            }
            None => Err(Error::Allocation { bytes: size, reason: "staging memory is not mapped".into() }),
        });
        // SAFETY: the copy has completed.
        unsafe { shared.device.destroy_buffer(staging, None) };
        let _ = state.allocator.free(staging_allocation);
        copied.map(|_| out)
    }

    fn run(&self, dispatches: &[Dispatch]) -> Result<()> {
        if dispatches.is_empty() {
            return Ok(());
        }
        let shared = &self.shared;
        let mut guard = shared.lock();
        let state = &mut *guard;
        let pipelines = shared.pipelines_for(state, dispatches)?;
        shared.submit(state, |device, cb| shared.record_dispatches(device, cb, &pipelines, dispatches))
    }

    fn time(&self, dispatches: &[Dispatch], repeats: usize) -> Result<Vec<f64>> {
        let shared = &self.shared;
        let repeats = repeats.max(1) as u32;
        let mut guard = shared.lock();
        let state = &mut *guard;
        let pipelines = shared.pipelines_for(state, dispatches)?;
        shared.ensure_queries(state, 2 * repeats)?;
        let pool = state.query_pool;
        shared.submit(state, |device, cb| unsafe {
            device.cmd_reset_query_pool(cb, pool, 0, 2 * repeats);
            for r in 0..repeats {
                if r > 0 {
                    compute_barrier(device, cb);
                }
                device.cmd_write_timestamp(cb, vk::PipelineStageFlags::BOTTOM_OF_PIPE, pool, 2 * r);
                shared.record_dispatches(device, cb, &pipelines, dispatches);
                device.cmd_write_timestamp(cb, vk::PipelineStageFlags::BOTTOM_OF_PIPE, pool, 2 * r + 1);
            }
        })?;
        let stamps = shared.read_timestamps(state, 2 * repeats)?;
        Ok(shared.seconds_between(&stamps))
    }
}
