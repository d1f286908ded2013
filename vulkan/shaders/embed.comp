#version 450
// Embedding gather: h[t, :] = E[ids[t] - id0, :] for the tokens whose id lies in this
// binding's rows [id0, id0 + rows) (a table larger than one binding comes in row chunks).
// E rows of D weights in the format FMT: 0 f32, 1 f16, 2 bf16 (as in wfmt.glsl), 3 Q8,
// 4 Q4 (row groups of 16 as in qblk.glsl, a chunk starting on a group).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint D = 256;
layout(constant_id = 1) const uint FMT = 0;

layout(std430, set = 0, binding = 0) readonly buffer Eb { uint W[]; };
layout(std430, set = 0, binding = 1) readonly buffer Ib { uint ids[]; };
layout(std430, set = 0, binding = 2) writeonly buffer Hb { float h[]; };

const uint QW = FMT == 3u ? 8u : 4u;
#include "qblk.glsl"
const uint GW = ((D + 63u) / 64u) * TILE_W;

layout(push_constant) uniform Push {
    uint id0;
    uint rows;
} pc;

// Weight i of row r of a block format: Q8 byte i % 4 of word i / 4; Q4 the nibble of
// weight i (qblk.glsl).
float qone(uint r, uint i) {
    const uint kb = i / 32u, ii = i % 32u, j = r % 16u;
    const uint tile = q_tile(GW, r / 16u, kb);
    const float d = q_scale(tile, kb, j);
    if (FMT == 3u) {
        const uint w = q_word(tile, kb, j, ii / 4u);
        return d * float(int(w << (24u - 8u * (ii % 4u))) >> 24);
    }
    const uint w = q_word(tile, kb, j, (ii % 16u) / 4u);
    return d * lv[(w >> (8u * (ii % 4u) + 4u * (ii / 16u))) & 15u];
}

void main() {
    load_levels();
    const uint t = gl_WorkGroupID.x;
    const uint id = ids[t];
    if (id < pc.id0 || id - pc.id0 >= pc.rows) return;
    const uint r = id - pc.id0;
    for (uint i = gl_LocalInvocationID.x; i < D; i += 64u) {
        float v;
        if (FMT == 0u) {
            v = uintBitsToFloat(W[r * D + i]);
        } else if (FMT >= 3u) {
            v = qone(r, i);
        } else {
            const uint w = W[(r * D + i) / 2u];
            const uint hi = i % 2u;
            v = FMT == 1u ? unpackHalf2x16(w)[hi]
                          : uintBitsToFloat(hi == 0u ? w << 16 : w & 0xffff0000u);
        }
        h[t * D + i] = v;
    }
}
