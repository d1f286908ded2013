#version 450
// Row operations on resident cache heads, in the decode kernel's head layout (decode.glsl:
// [cap rows of K][cap rows of V][cap meta uvec4 (c_hi, c_lo, pos_lo, pos_hi)], f32 rows of
// HD words). One workgroup per head slot (up to SLOTS head buffers per dispatch) runs its
// head's operations in order, a barrier after each, so a move may read a row an earlier one
// wrote (the retention policy's swap-deletes are applied exactly in the order it made them):
//   kind 0, move: row src -> row dst (K, V and meta);
//   kind 1, put: K and V of token src of the chunk (k, v head-major [H][n][HD], head
//        range.z) -> row dst, with meta b;
//   kind 2, meta: row dst's meta = b (a re-based c);
//   kind 3: nothing (an eviction a decode step decided against, gate_step.comp).
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint HD = 64;
#define SLOTS 8

layout(std430, set = 0, binding = 0) buffer Hb { uint x[]; } hb[SLOTS];
layout(std430, set = 0, binding = 1) readonly buffer Kb { float kin[]; };
layout(std430, set = 0, binding = 2) readonly buffer Vb { float vin[]; };
layout(std430, set = 0, binding = 3) readonly buffer Ob { uvec4 ops[]; };     // pairs (a, b)
layout(std430, set = 0, binding = 4) readonly buffer Rb { uvec4 range[]; };   // [slot] (first op, ops, head, cap)

layout(push_constant) uniform Push {
    uint n;   // tokens of the chunk
} pc;

void main() {
    const uint slot = gl_WorkGroupID.x;
    const uint tid = gl_LocalInvocationID.x;
    const uvec4 rg = range[slot];
    const uint cap = rg.w;
    const uint voff = cap * HD;
    const uint moff = 2u * cap * HD;
    for (uint i = 0; i < rg.y; ++i) {
        const uvec4 a = ops[2u * (rg.x + i)];
        const uvec4 b = ops[2u * (rg.x + i) + 1u];
        if (a.x == 0u) {
            for (uint c = tid; c < HD; c += 64u) {
                hb[slot].x[a.z * HD + c] = hb[slot].x[a.y * HD + c];
                hb[slot].x[voff + a.z * HD + c] = hb[slot].x[voff + a.y * HD + c];
            }
            if (tid < 4u) hb[slot].x[moff + 4u * a.z + tid] = hb[slot].x[moff + 4u * a.y + tid];
        } else if (a.x == 2u) {
            if (tid < 4u) hb[slot].x[moff + 4u * a.z + tid] = b[tid];
        } else if (a.x == 1u) {
            const uint src = (rg.z * pc.n + a.y) * HD;
            for (uint c = tid; c < HD; c += 64u) {
                hb[slot].x[a.z * HD + c] = floatBitsToUint(kin[src + c]);
                hb[slot].x[voff + a.z * HD + c] = floatBitsToUint(vin[src + c]);
            }
            if (tid < 4u) hb[slot].x[moff + 4u * a.z + tid] = b[tid];
        }
        memoryBarrierBuffer();
        barrier();
    }
}
