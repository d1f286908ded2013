#version 450
// Row operations on resident cache heads (rowops.glsl). Workgroup (s, g) applies head slot
// s's operations (up to SLOTS head buffers per dispatch) to columns g * COLS .. of its rows
// (column c: K[c], V[c] and meta word c if c < 4, c < W = max(HD, 4)); columns never
// interact, so the column groups run independently. The host sorts a head's operations
// into dependency levels (no two operations of a level touch a common row unless both
// only read it; each op's a.w = the end of its level, relative to the head's first op):
// the workgroup applies a level's operations at once, (op, column) pairs spread over its
// threads, with a buffer barrier between levels, so a move reads what an earlier level
// wrote and the result equals the serial application.
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint HD = 64;
#define SLOTS 8
#define THREADS 256u
#define COLS 8u

layout(std430, set = 0, binding = 0) coherent buffer Hb { uint x[]; } hb[SLOTS];
layout(std430, set = 0, binding = 1) readonly restrict buffer Kb { float kx[]; };
layout(std430, set = 0, binding = 2) readonly restrict buffer Vb { float vx[]; };
layout(std430, set = 0, binding = 3) readonly restrict buffer Ob { uvec4 ops[]; };     // pairs (a, b)
layout(std430, set = 0, binding = 4) readonly restrict buffer Rb { uvec4 range[]; };   // [slot] (first op, ops, head, cap)

layout(push_constant) uniform Push {
    uint n;   // tokens of the chunk
} pc;

#include "rowops.glsl"

void main() {
    const uint slot = gl_WorkGroupID.x;
    const uint c0 = gl_WorkGroupID.y * COLS;
    const uint tid = gl_LocalInvocationID.x;
    const uvec4 rg = range[slot];
    const uint w = max(HD, 4u);
    uint i = 0u;
    while (i < rg.y) {
        const uint end = clamp(ops[2u * (rg.x + i)].w, i + 1u, rg.y);
        const uint work = (end - i) * COLS;
        for (uint t = tid; t < work; t += THREADS) {
            const uint o = rg.x + i + t / COLS;
            const uint c = c0 + t % COLS;
            if (c < w) row_op_col(slot, rg.w, rg.z, pc.n, ops[2u * o], ops[2u * o + 1u], c);
        }
        memoryBarrierBuffer();
        barrier();
        i = end;
    }
}
