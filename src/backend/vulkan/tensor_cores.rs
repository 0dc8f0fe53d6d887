//! Whether a Vulkan device can run the tensor-core kernels (`shaders/common/tile_mma.slang`), and
//! the device features they need: bf16 × bf16 → f32 cooperative matrices of 16 × 16 × 16 at
//! subgroup scope (VK_KHR_cooperative_matrix, VK_KHR_shader_bfloat16), the Vulkan memory model
//! (Slang emits cooperative-matrix code under it), and a 32-wide subgroup (a tile's team).

use std::ffi::c_void;

use ash::vk;

pub const COOPERATIVE_MATRIX: &str = "VK_KHR_cooperative_matrix";
pub const SHADER_BFLOAT16: &str = "VK_KHR_shader_bfloat16";

/// `VkPhysicalDeviceShaderBfloat16FeaturesKHR` (VK_KHR_shader_bfloat16 is newer than ash's headers).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ShaderBfloat16Features {
    pub s_type: vk::StructureType,
    pub p_next: *mut c_void,
    pub shader_bfloat16_type: vk::Bool32,
    pub shader_bfloat16_dot_product: vk::Bool32,
    pub shader_bfloat16_cooperative_matrix: vk::Bool32,
}

/// `VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR`.
const SHADER_BFLOAT16_FEATURES: vk::StructureType = vk::StructureType::from_raw(1_000_141_000);
/// `VK_COMPONENT_TYPE_BFLOAT16_KHR`.
const COMPONENT_BFLOAT16: vk::ComponentTypeKHR = vk::ComponentTypeKHR::from_raw(1_000_141_000);

impl Default for ShaderBfloat16Features {
    fn default() -> Self {
        ShaderBfloat16Features {
            s_type: SHADER_BFLOAT16_FEATURES,
            p_next: std::ptr::null_mut(),
            shader_bfloat16_type: vk::FALSE,
            shader_bfloat16_dot_product: vk::FALSE,
            shader_bfloat16_cooperative_matrix: vk::FALSE,
        }
    }
}

// SAFETY: a #[repr(C)] Vulkan structure that starts with sType and pNext, as the chain requires.
unsafe impl vk::ExtendsPhysicalDeviceFeatures2 for ShaderBfloat16Features {}
unsafe impl vk::ExtendsDeviceCreateInfo for ShaderBfloat16Features {}

/// What the survey found: `Ok(())` when the tensor-core kernels can run, else why not.
pub type Support = std::result::Result<(), String>;

/// Checks a physical device for everything the tensor-core kernels need.
pub fn survey(
    entry: &ash::Entry,
    instance: &ash::Instance,
    physical: vk::PhysicalDevice,
    api_version: u32,
    extensions: &[String],
) -> Support {
    if api_version < vk::API_VERSION_1_3 {
        return Err("Vulkan 1.3".into());
    }
    let missing: Vec<&str> =
        [COOPERATIVE_MATRIX, SHADER_BFLOAT16].into_iter().filter(|e| !extensions.iter().any(|x| x == e)).collect();
    if !missing.is_empty() {
        return Err(missing.join(", "));
    }
    let mut cooperative = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
    let mut bfloat16 = ShaderBfloat16Features::default();
    let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut features =
        vk::PhysicalDeviceFeatures2::default().push_next(&mut cooperative).push_next(&mut bfloat16).push_next(&mut f12);
    // SAFETY: a valid physical device; the chain holds structures of extensions it offers.
    unsafe { instance.get_physical_device_features2(physical, &mut features) };
    let checks = [
        (cooperative.cooperative_matrix, "cooperativeMatrix"),
        (bfloat16.shader_bfloat16_type, "shaderBFloat16Type"),
        (bfloat16.shader_bfloat16_cooperative_matrix, "shaderBFloat16CooperativeMatrix"),
        (f12.vulkan_memory_model, "vulkanMemoryModel"),
        (f12.vulkan_memory_model_device_scope, "vulkanMemoryModelDeviceScope"),
    ];
    let absent: Vec<&str> = checks.iter().filter(|(v, _)| *v == vk::FALSE).map(|(_, n)| *n).collect();
    if !absent.is_empty() {
        return Err(absent.join(", "));
    }
    let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
    let mut properties = vk::PhysicalDeviceProperties2::default().push_next(&mut subgroup);
    unsafe { instance.get_physical_device_properties2(physical, &mut properties) };
    if subgroup.subgroup_size != 32 {
        return Err(format!("a 32-wide subgroup (the device's is {})", subgroup.subgroup_size));
    }
    let loader = ash::khr::cooperative_matrix::Instance::new(entry, instance);
    // SAFETY: the device offers VK_KHR_cooperative_matrix.
    let shapes = unsafe { loader.get_physical_device_cooperative_matrix_properties(physical) }
        .map_err(|e| format!("vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR: {e:?}"))?;
    let wanted = shapes.iter().any(|s| {
        (s.m_size, s.n_size, s.k_size) == (16, 16, 16)
            && s.a_type == COMPONENT_BFLOAT16
            && s.b_type == COMPONENT_BFLOAT16
            && s.c_type == vk::ComponentTypeKHR::FLOAT32
            && s.result_type == vk::ComponentTypeKHR::FLOAT32
            && s.scope == vk::ScopeKHR::SUBGROUP
    });
    if !wanted {
        let offered: Vec<String> = shapes
            .iter()
            .map(|s| {
                format!(
                    "{}x{}x{} {:?}·{:?}+{:?} scope {:?}",
                    s.m_size, s.n_size, s.k_size, s.a_type, s.b_type, s.c_type, s.scope
                )
            })
            .collect();
        return Err(format!(
            "a bf16 × bf16 → f32 16×16×16 subgroup cooperative matrix (offered: {})",
            offered.join("; ")
        ));
    }
    Ok(())
}
