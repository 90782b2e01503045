#include "native.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static PFN_vkGetInstanceProcAddr gipa;

void *vks_load_loader(const char **which) {
	static const char *names[] = {"libvulkan.so.1", "libvulkan.so"};
	for (int i = 0; i < 2; i++) {
		void *lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
		if (!lib) continue;
		void *f = dlsym(lib, "vkGetInstanceProcAddr");
		if (f) {
			*which = names[i];
			gipa = (PFN_vkGetInstanceProcAddr)f;
			return f;
		}
	}
	return NULL;
}

void vks_query(VkInstance instance, VkPhysicalDevice pd, vks_facts *f) {
	memset(f, 0, sizeof *f);
	PFN_vkGetPhysicalDeviceProperties2 props2 =
		(PFN_vkGetPhysicalDeviceProperties2)gipa(instance, "vkGetPhysicalDeviceProperties2");
	PFN_vkGetPhysicalDeviceFeatures2 feats2 =
		(PFN_vkGetPhysicalDeviceFeatures2)gipa(instance, "vkGetPhysicalDeviceFeatures2");
	PFN_vkGetPhysicalDeviceMemoryProperties memprops =
		(PFN_vkGetPhysicalDeviceMemoryProperties)gipa(instance, "vkGetPhysicalDeviceMemoryProperties");
	PFN_vkEnumerateDeviceExtensionProperties exts =
		(PFN_vkEnumerateDeviceExtensionProperties)gipa(instance, "vkEnumerateDeviceExtensionProperties");

	int has_driver_props = 0, has_coopmat = 0, has_memory_model = 0, has_exec = 0, has_dot = 0;
	uint32_t n = 0;
	if (exts && exts(pd, NULL, &n, NULL) == VK_SUCCESS && n > 0) {
		VkExtensionProperties *e = calloc(n, sizeof *e);
		if (e && exts(pd, NULL, &n, e) == VK_SUCCESS) {
			for (uint32_t i = 0; i < n; i++) {
				if (strcmp(e[i].extensionName, VK_KHR_DRIVER_PROPERTIES_EXTENSION_NAME) == 0)
					has_driver_props = 1;
				if (strcmp(e[i].extensionName, VK_NV_COOPERATIVE_MATRIX_EXTENSION_NAME) == 0)
					has_coopmat = 1;
				if (strcmp(e[i].extensionName, VK_KHR_VULKAN_MEMORY_MODEL_EXTENSION_NAME) == 0)
					has_memory_model = 1;
				if (strcmp(e[i].extensionName, VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME) == 0)
					has_exec = 1;
				if (strcmp(e[i].extensionName, VK_KHR_SHADER_INTEGER_DOT_PRODUCT_EXTENSION_NAME) == 0)
					has_dot = 1;
			}
		}
		free(e);
	}

	VkPhysicalDeviceDriverProperties drv = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES};
	VkPhysicalDeviceMaintenance3Properties m3 = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES};
	VkPhysicalDeviceSubgroupProperties sg = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES};
	VkPhysicalDeviceShaderIntegerDotProductProperties dotp = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_PROPERTIES};
	VkPhysicalDeviceProperties2 p2 = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
	p2.pNext = &sg;
	sg.pNext = &m3;
	if (has_dot) {
		sg.pNext = &dotp;
		dotp.pNext = &m3;
	}
	if (has_driver_props) m3.pNext = &drv;
	props2(pd, &p2);
	VkPhysicalDeviceProperties *p = &p2.properties;
	strncpy(f->name, p->deviceName, sizeof f->name - 1);
	f->api_version = p->apiVersion;
	f->driver_version = p->driverVersion;
	f->vendor_id = p->vendorID;
	f->device_id = p->deviceID;
	f->device_type = p->deviceType;
	if (has_driver_props) {
		strncpy(f->driver_name, drv.driverName, sizeof f->driver_name - 1);
		strncpy(f->driver_info, drv.driverInfo, sizeof f->driver_info - 1);
	}
	f->subgroup_size = sg.subgroupSize;
	f->subgroup_stages = sg.supportedStages;
	f->subgroup_ops = sg.supportedOperations;
	f->max_wg_invocations = p->limits.maxComputeWorkGroupInvocations;
	for (int i = 0; i < 3; i++) {
		f->max_wg_size[i] = p->limits.maxComputeWorkGroupSize[i];
		f->max_wg_count[i] = p->limits.maxComputeWorkGroupCount[i];
	}
	f->max_shared_memory = p->limits.maxComputeSharedMemorySize;
	f->max_storage_range = p->limits.maxStorageBufferRange;
	f->max_push_constants = p->limits.maxPushConstantsSize;
	f->max_allocation = m3.maxMemoryAllocationSize;
	f->min_storage_offset_align = p->limits.minStorageBufferOffsetAlignment;
	f->timestamp_period = p->limits.timestampPeriod;

	VkPhysicalDeviceShaderFloat16Int8Features f16 = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES};
	VkPhysicalDevice16BitStorageFeatures s16 = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES};
	VkPhysicalDeviceCooperativeMatrixFeaturesNV cm = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_NV};
	VkPhysicalDeviceVulkanMemoryModelFeaturesKHR mm = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES_KHR};
	VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR ex = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR};
	VkPhysicalDeviceShaderIntegerDotProductFeatures dotf = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES};
	VkPhysicalDeviceFeatures2 ft = {VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
	ft.pNext = &s16;
	s16.pNext = &f16;
	if (has_dot) {
		s16.pNext = &dotf;
		dotf.pNext = &f16;
	}
	void **tail = &f16.pNext;
	if (has_coopmat && has_memory_model) {
		f16.pNext = &cm;
		cm.pNext = &mm;
		tail = &mm.pNext;
	}
	if (has_exec) *tail = &ex;
	feats2(pd, &ft);
	f->executable_stats = has_exec && ex.pipelineExecutableInfo;
	f->integer_dot = has_dot && dotf.shaderIntegerDotProduct;
	f->integer_dot_fast = f->integer_dot && dotp.integerDotProduct4x8BitPackedSignedAccelerated;
	f->storage_16bit = s16.storageBuffer16BitAccess;
	f->float16 = f16.shaderFloat16;
	f->int8 = f16.shaderInt8;
	f->int64 = ft.features.shaderInt64;
	f->storage_buffer_array_dynamic = ft.features.shaderStorageBufferArrayDynamicIndexing;

	PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesNV cmprops =
		(PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesNV)gipa(instance, "vkGetPhysicalDeviceCooperativeMatrixPropertiesNV");
	if (has_coopmat && has_memory_model && cm.cooperativeMatrix && mm.vulkanMemoryModel && mm.vulkanMemoryModelDeviceScope && cmprops) {
		uint32_t m = 0;
		if (cmprops(pd, &m, NULL) == VK_SUCCESS && m > 0) {
			VkCooperativeMatrixPropertiesNV *cp = calloc(m, sizeof *cp);
			if (cp) {
				for (uint32_t i = 0; i < m; i++) cp[i].sType = VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_NV;
				if (cmprops(pd, &m, cp) == VK_SUCCESS) {
					for (uint32_t i = 0; i < m; i++) {
						if (cp[i].MSize == 16 && cp[i].NSize == 16 && cp[i].KSize == 16 &&
							cp[i].AType == VK_COMPONENT_TYPE_FLOAT16_NV && cp[i].BType == VK_COMPONENT_TYPE_FLOAT16_NV &&
							cp[i].CType == VK_COMPONENT_TYPE_FLOAT32_NV && cp[i].DType == VK_COMPONENT_TYPE_FLOAT32_NV &&
							cp[i].scope == VK_SCOPE_SUBGROUP_NV)
							f->coopmat_nv = 1;
					}
				}
				free(cp);
			}
		}
	}

	VkPhysicalDeviceMemoryProperties mp;
	memprops(pd, &mp);
	for (uint32_t i = 0; i < mp.memoryHeapCount; i++)
		if (mp.memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)
			f->device_local_bytes += mp.memoryHeaps[i].size;
}

typedef struct {
	VkPhysicalDeviceFeatures2 base;
	VkPhysicalDevice16BitStorageFeatures s16;
	VkPhysicalDeviceShaderFloat16Int8Features f16;
	VkPhysicalDeviceCooperativeMatrixFeaturesNV cm;
	VkPhysicalDeviceVulkanMemoryModelFeaturesKHR mm;
	VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR ex;
	VkPhysicalDeviceShaderIntegerDotProductFeatures dot;
} feature_chain;

static const char *const coopmat_extensions[] = {VK_NV_COOPERATIVE_MATRIX_EXTENSION_NAME, VK_KHR_VULKAN_MEMORY_MODEL_EXTENSION_NAME};

const char *const *vks_coopmat_extensions(uint32_t *count) {
	*count = 2;
	return coopmat_extensions;
}

void *vks_features(int storage_16bit, int float16, int int64, int coopmat_nv, int executable_stats, int integer_dot) {
	feature_chain *c = calloc(1, sizeof *c);
	if (!c) return NULL;
	c->base.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2;
	c->s16.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES;
	c->f16.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES;
	c->base.pNext = &c->s16;
	c->s16.pNext = &c->f16;
	c->s16.storageBuffer16BitAccess = storage_16bit ? VK_TRUE : VK_FALSE;
	c->f16.shaderFloat16 = float16 ? VK_TRUE : VK_FALSE;
	c->base.features.shaderInt64 = int64 ? VK_TRUE : VK_FALSE;
	if (coopmat_nv) {
		c->cm.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_NV;
		c->mm.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_MEMORY_MODEL_FEATURES_KHR;
		c->f16.pNext = &c->cm;
		c->cm.pNext = &c->mm;
		c->cm.cooperativeMatrix = VK_TRUE;
		c->mm.vulkanMemoryModel = VK_TRUE;
		c->mm.vulkanMemoryModelDeviceScope = VK_TRUE; // device-scope atomics of the other kernels
	}
	if (executable_stats) {
		c->ex.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR;
		c->ex.pipelineExecutableInfo = VK_TRUE;
		c->ex.pNext = c->f16.pNext; // first in the chain after f16
		c->f16.pNext = &c->ex;
	}
	if (integer_dot) {
		c->dot.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES;
		c->dot.shaderIntegerDotProduct = VK_TRUE;
		c->dot.pNext = c->f16.pNext;
		c->f16.pNext = &c->dot;
	}
	return c;
}

// Recorded messages: a ring of the most recent ones.
enum { RING = 64, MSG_LEN = 2048 };
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char ring[RING][MSG_LEN];
static uint64_t total, errors;

static VKAPI_ATTR VkBool32 VKAPI_CALL on_message(
	VkDebugUtilsMessageSeverityFlagBitsEXT severity,
	VkDebugUtilsMessageTypeFlagsEXT types,
	const VkDebugUtilsMessengerCallbackDataEXT *data, void *user) {
	(void)types;
	(void)user;
	pthread_mutex_lock(&mu);
	const char *level = (severity & VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT) ? "error" : "warning";
	snprintf(ring[total % RING], MSG_LEN, "%s: %s", level, data && data->pMessage ? data->pMessage : "(no message)");
	total++;
	if (severity & VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT) errors++;
	pthread_mutex_unlock(&mu);
	return VK_FALSE;
}

VkResult vks_messenger_create(VkInstance instance, VkDebugUtilsMessengerEXT *out) {
	PFN_vkCreateDebugUtilsMessengerEXT create =
		(PFN_vkCreateDebugUtilsMessengerEXT)gipa(instance, "vkCreateDebugUtilsMessengerEXT");
	if (!create) return VK_ERROR_EXTENSION_NOT_PRESENT;
	VkDebugUtilsMessengerCreateInfoEXT ci = {VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT};
	ci.messageSeverity = VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT | VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT;
	ci.messageType = VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT | VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT;
	ci.pfnUserCallback = on_message;
	return create(instance, &ci, NULL, out);
}

uint64_t vks_messages_errors(void) {
	pthread_mutex_lock(&mu);
	uint64_t e = errors;
	pthread_mutex_unlock(&mu);
	return e;
}

uint64_t vks_messages_total(void) {
	pthread_mutex_lock(&mu);
	uint64_t t = total;
	pthread_mutex_unlock(&mu);
	return t;
}

int vks_messages_copy(uint64_t i, char *buf, int len) {
	pthread_mutex_lock(&mu);
	int ok = 0;
	if (i < total && total - i <= RING) {
		strncpy(buf, ring[i % RING], len - 1);
		buf[len - 1] = 0;
		ok = 1;
	}
	pthread_mutex_unlock(&mu);
	return ok;
}

VkResult vks_create_compute_pipeline(VkInstance instance, VkDevice device, VkShaderModule module,
	VkPipelineLayout layout, const uint32_t *spec, uint32_t spec_count, int capture, VkPipeline *out) {
	PFN_vkCreateComputePipelines create =
		(PFN_vkCreateComputePipelines)gipa(instance, "vkCreateComputePipelines");
	if (!create) return VK_ERROR_INITIALIZATION_FAILED;
	VkSpecializationMapEntry *entries = NULL;
	VkSpecializationInfo si = {0};
	if (spec_count > 0) {
		entries = calloc(spec_count, sizeof *entries);
		if (!entries) return VK_ERROR_OUT_OF_HOST_MEMORY;
		for (uint32_t i = 0; i < spec_count; i++) {
			entries[i].constantID = i;
			entries[i].offset = 4 * i;
			entries[i].size = 4;
		}
		si.mapEntryCount = spec_count;
		si.pMapEntries = entries;
		si.dataSize = 4 * (size_t)spec_count;
		si.pData = spec;
	}
	VkComputePipelineCreateInfo ci = {VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO};
	if (capture) ci.flags = VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR;
	ci.stage.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO;
	ci.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
	ci.stage.module = module;
	ci.stage.pName = "main";
	ci.stage.pSpecializationInfo = spec_count > 0 ? &si : NULL;
	ci.layout = layout;
	VkResult r = create(device, VK_NULL_HANDLE, 1, &ci, NULL, out);
	free(entries);
	return r;
}

VkResult vks_pipeline_statistics(VkInstance instance, VkDevice device, VkPipeline pipeline, char *buf, int len) {
	PFN_vkGetPipelineExecutableStatisticsKHR stats =
		(PFN_vkGetPipelineExecutableStatisticsKHR)gipa(instance, "vkGetPipelineExecutableStatisticsKHR");
	if (!stats || len < 1) return VK_ERROR_EXTENSION_NOT_PRESENT;
	buf[0] = 0;
	VkPipelineExecutableInfoKHR info = {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR};
	info.pipeline = pipeline;
	info.executableIndex = 0;
	uint32_t n = 0;
	VkResult r = stats(device, &info, &n, NULL);
	if (r != VK_SUCCESS || n == 0) return r;
	VkPipelineExecutableStatisticKHR *s = calloc(n, sizeof *s);
	if (!s) return VK_ERROR_OUT_OF_HOST_MEMORY;
	for (uint32_t i = 0; i < n; i++) s[i].sType = VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR;
	r = stats(device, &info, &n, s);
	if (r == VK_SUCCESS || r == VK_INCOMPLETE) {
		int at = 0;
		for (uint32_t i = 0; i < n && at < len; i++) {
			int w = 0;
			switch (s[i].format) {
			case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR:
				w = snprintf(buf + at, len - at, "%s\t%s\n", s[i].name, s[i].value.b32 ? "true" : "false");
				break;
			case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR:
				w = snprintf(buf + at, len - at, "%s\t%lld\n", s[i].name, (long long)s[i].value.i64);
				break;
			case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR:
				w = snprintf(buf + at, len - at, "%s\t%llu\n", s[i].name, (unsigned long long)s[i].value.u64);
				break;
			default:
				w = snprintf(buf + at, len - at, "%s\t%g\n", s[i].name, s[i].value.f64);
			}
			if (w < 0) break;
			at += w;
		}
		r = VK_SUCCESS;
	}
	free(s);
	return r;
}

// The calls made for every transfer, binding and dispatch, resolved once:
// the loader's entry points dispatch on the handle, so they serve every
// instance and device.
static PFN_vkUpdateDescriptorSets p_update_sets;
static PFN_vkCreateDescriptorPool p_create_pool;
static PFN_vkDestroyDescriptorPool p_destroy_pool;
static PFN_vkAllocateDescriptorSets p_alloc_sets;
static PFN_vkCmdCopyBuffer p_copy;
static PFN_vkCmdPipelineBarrier p_barrier;
static PFN_vkCmdBindPipeline p_bind_pipeline;
static PFN_vkCmdBindDescriptorSets p_bind_sets;
static PFN_vkCmdPushConstants p_push;
static PFN_vkQueueSubmit p_submit;
static PFN_vkGetFenceStatus p_fence_status;
static PFN_vkWaitForFences p_wait_fences;
static PFN_vkResetFences p_reset_fences;
static PFN_vkResetCommandBuffer p_reset_cb;
static PFN_vkBeginCommandBuffer p_begin_cb;
static pthread_once_t hot_once = PTHREAD_ONCE_INIT;
static VkInstance hot_instance;

static void hot_resolve(void) {
	p_update_sets = (PFN_vkUpdateDescriptorSets)gipa(hot_instance, "vkUpdateDescriptorSets");
	p_create_pool = (PFN_vkCreateDescriptorPool)gipa(hot_instance, "vkCreateDescriptorPool");
	p_destroy_pool = (PFN_vkDestroyDescriptorPool)gipa(hot_instance, "vkDestroyDescriptorPool");
	p_alloc_sets = (PFN_vkAllocateDescriptorSets)gipa(hot_instance, "vkAllocateDescriptorSets");
	p_copy = (PFN_vkCmdCopyBuffer)gipa(hot_instance, "vkCmdCopyBuffer");
	p_barrier = (PFN_vkCmdPipelineBarrier)gipa(hot_instance, "vkCmdPipelineBarrier");
	p_bind_pipeline = (PFN_vkCmdBindPipeline)gipa(hot_instance, "vkCmdBindPipeline");
	p_bind_sets = (PFN_vkCmdBindDescriptorSets)gipa(hot_instance, "vkCmdBindDescriptorSets");
	p_push = (PFN_vkCmdPushConstants)gipa(hot_instance, "vkCmdPushConstants");
	p_submit = (PFN_vkQueueSubmit)gipa(hot_instance, "vkQueueSubmit");
	p_fence_status = (PFN_vkGetFenceStatus)gipa(hot_instance, "vkGetFenceStatus");
	p_wait_fences = (PFN_vkWaitForFences)gipa(hot_instance, "vkWaitForFences");
	p_reset_fences = (PFN_vkResetFences)gipa(hot_instance, "vkResetFences");
	p_reset_cb = (PFN_vkResetCommandBuffer)gipa(hot_instance, "vkResetCommandBuffer");
	p_begin_cb = (PFN_vkBeginCommandBuffer)gipa(hot_instance, "vkBeginCommandBuffer");
}

int vks_hot_init(VkInstance instance) {
	hot_instance = instance;
	pthread_once(&hot_once, hot_resolve);
	return p_reset_cb && p_begin_cb && p_fence_status && p_wait_fences && p_reset_fences && p_update_sets && p_create_pool && p_destroy_pool && p_alloc_sets && p_copy && p_barrier && p_bind_pipeline && p_bind_sets && p_push && p_submit;
}

VkResult vks_make_buffer_set(VkDevice device, VkDescriptorSetLayout layout, uint32_t n,
	const VkBuffer *buffers, const uint64_t *offsets, const uint64_t *ranges,
	VkDescriptorPool *pool_out, VkDescriptorSet *set_out) {
	VkDescriptorPoolSize size = {VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, n > 0 ? n : 1};
	VkDescriptorPoolCreateInfo pci = {VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO};
	pci.maxSets = 1;
	pci.poolSizeCount = 1;
	pci.pPoolSizes = &size;
	VkDescriptorPool pool;
	VkResult r = p_create_pool(device, &pci, NULL, &pool);
	if (r != VK_SUCCESS) return r;
	VkDescriptorSetAllocateInfo ai = {VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO};
	ai.descriptorPool = pool;
	ai.descriptorSetCount = 1;
	ai.pSetLayouts = &layout;
	VkDescriptorSet set;
	r = p_alloc_sets(device, &ai, &set);
	if (r != VK_SUCCESS) {
		p_destroy_pool(device, pool, NULL);
		return r;
	}
	VkDescriptorBufferInfo *infos = calloc(n > 0 ? n : 1, sizeof *infos);
	VkWriteDescriptorSet *writes = calloc(n > 0 ? n : 1, sizeof *writes);
	if (!infos || !writes) {
		free(infos);
		free(writes);
		p_destroy_pool(device, pool, NULL);
		return VK_ERROR_OUT_OF_HOST_MEMORY;
	}
	if (n > 0) {
		for (uint32_t i = 0; i < n; i++) {
			infos[i].buffer = buffers[i];
			infos[i].offset = offsets[i];
			infos[i].range = ranges[i];
			writes[i].sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET;
			writes[i].dstSet = set;
			writes[i].dstBinding = i;
			writes[i].descriptorCount = 1;
			writes[i].descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
			writes[i].pBufferInfo = &infos[i];
		}
		p_update_sets(device, n, writes, 0, NULL);
	}
	free(infos);
	free(writes);
	*pool_out = pool;
	*set_out = set;
	return VK_SUCCESS;
}

void vks_cmd_copy(VkCommandBuffer cb, VkBuffer src, VkBuffer dst, uint64_t src_offset, uint64_t dst_offset, uint64_t size) {
	VkBufferCopy region = {src_offset, dst_offset, size};
	p_copy(cb, src, dst, 1, &region);
}

void vks_cmd_barrier(VkCommandBuffer cb, uint32_t src_stages, uint32_t dst_stages, uint32_t src_access, uint32_t dst_access) {
	VkMemoryBarrier mb = {VK_STRUCTURE_TYPE_MEMORY_BARRIER};
	mb.srcAccessMask = src_access;
	mb.dstAccessMask = dst_access;
	p_barrier(cb, src_stages, dst_stages, 0, 1, &mb, 0, NULL, 0, NULL);
}

void vks_cmd_bind_kernel(VkCommandBuffer cb, VkPipeline pipeline, VkPipelineLayout layout, VkDescriptorSet set,
	const uint32_t *push, uint32_t push_words) {
	p_bind_pipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, pipeline);
	p_bind_sets(cb, VK_PIPELINE_BIND_POINT_COMPUTE, layout, 0, 1, &set, 0, NULL);
	if (push_words > 0) p_push(cb, layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, 4 * push_words, push);
}

VkResult vks_queue_submit(VkQueue queue, VkCommandBuffer cb, VkFence fence) {
	VkSubmitInfo si = {VK_STRUCTURE_TYPE_SUBMIT_INFO};
	si.commandBufferCount = 1;
	si.pCommandBuffers = &cb;
	return p_submit(queue, 1, &si, fence);
}

static uint64_t now_ns(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

VkResult vks_wait_fence(VkDevice device, VkFence fence, uint64_t spin_ns, uint64_t timeout_ns, const char **which) {
	uint64_t start = now_ns();
	VkResult r;
	*which = "vkGetFenceStatus";
	while ((r = p_fence_status(device, fence)) == VK_NOT_READY && now_ns() - start < spin_ns) {
	}
	if (r == VK_NOT_READY) {
		*which = "vkWaitForFences";
		r = p_wait_fences(device, 1, &fence, VK_TRUE, timeout_ns);
	}
	if (r != VK_SUCCESS) return r;
	*which = "vkResetFences";
	return p_reset_fences(device, 1, &fence);
}

VkResult vks_begin(VkCommandBuffer cb, const char **which) {
	*which = "vkResetCommandBuffer";
	VkResult r = p_reset_cb(cb, 0);
	if (r != VK_SUCCESS) return r;
	*which = "vkBeginCommandBuffer";
	VkCommandBufferBeginInfo bi = {VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
	return p_begin_cb(cb, &bi);
}
