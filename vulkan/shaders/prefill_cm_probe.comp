#version 450
// Reports where a 16 x 16 f32 cooperative matrix (NV) keeps its elements: loads a matrix
// whose element (r, c) holds 16 r + c and writes lane L's element e to out[1 + 8 L + e],
// 8 per lane (runs with 32-lane subgroups only: 256 elements / 32 lanes), and 8 to out[0].
// prefill.rs checks that the 256 values cover the matrix once and derives the layout
// prefill_fa.glsl runs with. (No length(): vulkano's SPIR-V parser does not know the
// spec-constant opcode glslang emits for it.)
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;   // one subgroup
layout(std430, set = 0, binding = 0) readonly buffer Ib { float idx[]; };   // [256]
layout(std430, set = 0, binding = 1) writeonly buffer Ob { float outv[]; };  // [1 + 8 * lanes]

void main() {
    fcoopmatNV<32, gl_ScopeSubgroup, 16, 16> m;
    coopMatLoadNV(m, idx, 0u, 16u, false);
    const uint lane = gl_SubgroupInvocationID;
    if (lane == 0u) outv[0] = 8.0 + idx[0];
    [[unroll]] for (uint e = 0; e < 8u; ++e) outv[1u + 8u * lane + e] = m[e];
}
