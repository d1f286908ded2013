#version 450
// Row operations on resident cache heads (rowops.glsl), one workgroup per head slot (up to
// SLOTS head buffers per dispatch) running its head's operations in order, a barrier after
// each, so a move may read a row an earlier one wrote (the retention policy's swap-deletes
// are applied exactly in the order it made them).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint HD = 64;
#define SLOTS 8

layout(std430, set = 0, binding = 0) buffer Hb { uint x[]; } hb[SLOTS];
layout(std430, set = 0, binding = 1) readonly buffer Kb { float kx[]; };
layout(std430, set = 0, binding = 2) readonly buffer Vb { float vx[]; };
layout(std430, set = 0, binding = 3) readonly buffer Ob { uvec4 ops[]; };     // pairs (a, b)
layout(std430, set = 0, binding = 4) readonly buffer Rb { uvec4 range[]; };   // [slot] (first op, ops, head, cap)

layout(push_constant) uniform Push {
    uint n;   // tokens of the chunk
} pc;

#include "rowops.glsl"

void main() {
    const uint slot = gl_WorkGroupID.x;
    const uint tid = gl_LocalInvocationID.x;
    const uvec4 rg = range[slot];
    for (uint i = 0; i < rg.y; ++i) {
        row_op(slot, rg.w, rg.z, pc.n, ops[2u * (rg.x + i)], ops[2u * (rg.x + i) + 1u], tid);
        memoryBarrierBuffer();
        barrier();
    }
}
