// Native helpers for package vk: loading the Vulkan loader, querying device
// facts through pNext chains, building feature chains for device creation,
// and a debug-utils messenger whose callback stays in C (a Go callback would
// break cgo's pointer rules).
#ifndef VKSPARSE_NATIVE_H
#define VKSPARSE_NATIVE_H

#include <stdint.h>
#include <vulkan/vulkan.h>

// vks_load_loader opens the Vulkan loader (libvulkan.so.1, then libvulkan.so)
// and returns its vkGetInstanceProcAddr, or NULL; *which names the library.
void *vks_load_loader(const char **which);

typedef struct {
	char name[256];
	uint32_t api_version, driver_version, vendor_id, device_id, device_type;
	char driver_name[256], driver_info[256];
	uint32_t subgroup_size, subgroup_stages, subgroup_ops;
	uint32_t max_wg_invocations, max_wg_size[3], max_wg_count[3];
	uint32_t max_shared_memory, max_storage_range, max_push_constants;
	uint64_t max_allocation, min_storage_offset_align;
	float timestamp_period;
	uint32_t storage_16bit, float16, int8, int64, storage_buffer_array_dynamic;
	uint64_t device_local_bytes;
	// coopmat_nv: VK_NV_cooperative_matrix and VK_KHR_vulkan_memory_model
	// are present and their features on, and the device multiplies 16×16×16
	// fp16 matrices into fp32 at subgroup scope.
	uint32_t coopmat_nv;
	// executable_stats: VK_KHR_pipeline_executable_properties is present with
	// its pipelineExecutableInfo feature (compilers' statistics per pipeline).
	uint32_t executable_stats;
	// integer_dot: VK_KHR_shader_integer_dot_product is present with its
	// shaderIntegerDotProduct feature; integer_dot_fast: the device says dot
	// products of two words of four signed bytes are accelerated.
	uint32_t integer_dot, integer_dot_fast;
} vks_facts;

// vks_query fills facts for a physical device.
void vks_query(VkInstance instance, VkPhysicalDevice pd, vks_facts *facts);

// vks_features returns a malloc'd VkPhysicalDeviceFeatures2 chain enabling the
// named optional features; free it with free() after vkCreateDevice.
// coopmat_nv adds the cooperative-matrix and Vulkan-memory-model features
// (the caller enables their extensions, vks_coopmat_extensions).
// executable_stats adds pipelineExecutableInfo (the caller enables
// VK_KHR_pipeline_executable_properties). integer_dot adds
// shaderIntegerDotProduct (the caller enables
// VK_KHR_shader_integer_dot_product).
void *vks_features(int storage_16bit, int float16, int int64, int coopmat_nv, int executable_stats, int integer_dot);

// vks_coopmat_extensions returns the device extensions that coopmat_nv needs.
const char *const *vks_coopmat_extensions(uint32_t *count);

// vks_messenger_create installs a debug-utils messenger that records
// validation messages for as long as the instance lives.
VkResult vks_messenger_create(VkInstance instance, VkDebugUtilsMessengerEXT *out);

// vks_messages_errors returns how many error messages were recorded so far.
uint64_t vks_messages_errors(void);
// vks_messages_copy copies recorded message i (0 = oldest kept) into buf and
// returns 1, or returns 0 when i is past the kept messages.
int vks_messages_copy(uint64_t i, char *buf, int len);
// vks_messages_total returns how many messages were recorded in all.
uint64_t vks_messages_total(void);

// vks_create_compute_pipeline creates a compute pipeline of entry point
// main with spec_count 32-bit specialization constants, IDs 0, 1, ...
// Every structure it passes lives in C for the whole call (the binding's
// copies of slices can be freed by the Go collector while a call that takes
// long, like a pipeline compile, still reads them).
// With capture set, the driver keeps the compiler's statistics
// (vks_pipeline_statistics).
VkResult vks_create_compute_pipeline(VkInstance instance, VkDevice device, VkShaderModule module,
	VkPipelineLayout layout, const uint32_t *spec, uint32_t spec_count, int capture, VkPipeline *out);

// vks_pipeline_statistics writes the statistics of the pipeline's first
// executable into buf as lines "name\tvalue\n" (values as the driver
// formats them: integers, floats or booleans), at most len bytes with the
// terminating 0.
VkResult vks_pipeline_statistics(VkInstance instance, VkDevice device, VkPipeline pipeline, char *buf, int len);

// vks_hot_init resolves, once per process, the calls below (made for every
// transfer, binding and dispatch, where the Go binding's marshalling of
// structs costs more than the call); it returns 0 when one is missing.
int vks_hot_init(VkInstance instance);
// vks_make_buffer_set creates a descriptor pool holding one set of layout
// and points the set's binding i at [offsets[i], +ranges[i]) of
// buffers[i], for i < n; on failure nothing is left created.
VkResult vks_make_buffer_set(VkDevice device, VkDescriptorSetLayout layout, uint32_t n,
	const VkBuffer *buffers, const uint64_t *offsets, const uint64_t *ranges,
	VkDescriptorPool *pool_out, VkDescriptorSet *set_out);
// vks_cmd_copy records one buffer copy.
void vks_cmd_copy(VkCommandBuffer cb, VkBuffer src, VkBuffer dst, uint64_t src_offset, uint64_t dst_offset, uint64_t size);
// vks_cmd_barrier records one global memory barrier.
void vks_cmd_barrier(VkCommandBuffer cb, uint32_t src_stages, uint32_t dst_stages, uint32_t src_access, uint32_t dst_access);
// vks_cmd_bind_kernel binds a compute pipeline, its descriptor set and its
// push constants.
void vks_cmd_bind_kernel(VkCommandBuffer cb, VkPipeline pipeline, VkPipelineLayout layout, VkDescriptorSet set,
	const uint32_t *push, uint32_t push_words);
// vks_queue_submit submits one command buffer, signalling fence.
VkResult vks_queue_submit(VkQueue queue, VkCommandBuffer cb, VkFence fence);
// vks_wait_fence waits until fence is signalled, polling it for up to
// spin_ns (a short submission's result comes back sooner than a sleeping
// wait wakes up), then blocking for up to timeout_ns, and resets it;
// *which names the call a failure came from.
VkResult vks_wait_fence(VkDevice device, VkFence fence, uint64_t spin_ns, uint64_t timeout_ns, const char **which);
// vks_begin resets cb and begins recording; *which names the call a
// failure came from.
VkResult vks_begin(VkCommandBuffer cb, const char **which);

#endif
