#version 450
// Row operations on resident cache heads (rowops.glsl), one workgroup per head slot (up to
// SLOTS head buffers per dispatch). The host sorts a head's operations into dependency
// levels (no two operations of a level touch a common row unless both only read it; each
// op's a.w = the end of its level, relative to the head's first op): the workgroup applies
// a level's operations at once, W = max(HD, 4) threads' worth of columns per op spread
// over its threads, with a buffer barrier between levels, so a move reads what an earlier
// level wrote and the result equals the serial application.
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint HD = 64;
#define SLOTS 8
#define THREADS 256u

layout(std430, set = 0, binding = 0) coherent buffer Hb { uint x[]; } hb[SLOTS];
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
    const uint w = max(HD, 4u);
    uint i = 0u;
    while (i < rg.y) {
        const uint end = clamp(ops[2u * (rg.x + i)].w, i + 1u, rg.y);
        const uint work = (end - i) * w;
        for (uint t = tid; t < work; t += THREADS) {
            const uint o = rg.x + i + t / w;
            row_op_col(slot, rg.w, rg.z, pc.n, ops[2u * o], ops[2u * o + 1u], t % w);
        }
        memoryBarrierBuffer();
        barrier();
        i = end;
    }
}
