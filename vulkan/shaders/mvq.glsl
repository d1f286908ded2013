// Matrix-vector product of decode for block-format weights (QFMT 8: Q8, 4: Q4; qblk.glsl),
// y[y_off + r] (+)= sum_i W[r, i] x[x_off + i] for r < rows, W [rows, K], dequantized in
// registers, f32 accumulation: per block, s = sum of its 32 products q x (Q4: level x),
// then acc += d s. One workgroup per group of 16 rows: thread (lane, j) takes row j and the
// blocks lane, lane + LANES, ... (the 16 rows' words of a block are 64 consecutive bytes);
// the LANES partial sums of a row are added in shared memory. Memory-bound: each weight
// byte is read once. The input is read through xin.glsl (XIN: as stored, RMS-normed, or the
// gated activation), staged once per workgroup in shared memory. With MULTI defined,
// several matrices of one input in one dispatch, as mv.glsl: weight bindings s < SLOTS, workgroups first_s .. first_s + ceil(rows_s / 16) - 1
// run binding s (unused bindings: first_s = 0xffffffff), the input at float 0, no ACC.
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WGS = 256;  // threads: 16 x LANES, LANES a power of two
layout(constant_id = 1) const uint K = 256;    // row length, a multiple of 32
layout(constant_id = 2) const uint ACC = 0;    // 1: add into y

#ifdef MULTI
#define SLOTS 8
layout(std430, set = 0, binding = 0) readonly buffer Wb { uint W[]; } wb[SLOTS];
uint wslot = 0u;
#define W wb[wslot].W
#else
layout(std430, set = 0, binding = 0) readonly buffer Wb { uint W[]; };
#endif
layout(std430, set = 0, binding = 1) readonly buffer Xb { vec4 x[]; };
layout(std430, set = 0, binding = 2) buffer Yb { float y[]; };

#if QFMT == 8
const uint QW = 8u;
#else
const uint QW = 4u;
#endif
#include "qblk.glsl"
#include "act.glsl"
const uint LANES = WGS / 16u;
const uint NB = K / 32u;                     // blocks of a row
const uint GW = ((K + 63u) / 64u) * TILE_W;  // words of a row group

#ifdef MULTI
layout(push_constant) uniform Push {
    uvec4 rows[SLOTS / 4];   // rows of each binding
    uvec4 y_off[SLOTS / 4];  // output index of its row 0
    uvec4 first[SLOTS / 4];  // its first workgroup
} pc;
#else
layout(push_constant) uniform Push {
    uint rows;    // rows of this weight binding (whole groups are stored)
    uint y_off;   // output index of its row 0
    uint x_off4;  // input offset in vec4
} pc;
#endif

shared float red[WGS];
#include "xin.glsl"

void main() {
    load_levels();
    const uint tid = gl_LocalInvocationID.x;
    const uint j = tid % 16u;
    const uint lane = tid / 16u;
#ifdef MULTI
    uint sl = 0u;
    [[unroll]] for (uint i = 1u; i < SLOTS; ++i) {
        if (gl_WorkGroupID.x >= pc.first[i / 4u][i % 4u]) sl = i;
    }
    wslot = sl;
    const uint g = gl_WorkGroupID.x - pc.first[sl / 4u][sl % 4u];
    const uint rows = pc.rows[sl / 4u][sl % 4u];
    const uint y_off = pc.y_off[sl / 4u][sl % 4u];
    const uint x_off4 = 0u;
#else
    const uint g = gl_WorkGroupID.x;
    const uint rows = pc.rows;
    const uint y_off = pc.y_off;
    const uint x_off4 = pc.x_off4;
#endif
    const uint r = 16u * g + j;
    float acc = 0.0;
    // Tiles of XT input vec4 (XT a multiple of 8: whole blocks).
    for (uint t0 = 0u; t0 < K / 4u; t0 += XT) {
        const uint n = min(XT, K / 4u - t0);
        if (t0 > 0u) barrier();
        xin_stage(x_off4, t0, n);
        const uint kb0 = t0 / 8u, kb1 = (t0 + n) / 8u;
        for (uint kb = kb0 + lane; kb < kb1; kb += LANES) {
            const uint tile = q_tile(GW, g, kb);
            const uint xb = 8u * (kb - kb0);
            float s = 0.0;
#if QFMT == 8
            [[unroll]] for (uint c = 0; c < 8u; ++c) {
                s += dot(q8x4(q_word(tile, kb, j, c)), xs[xb + c]);
            }
#else
            [[unroll]] for (uint c = 0; c < 4u; ++c) {
                const uint w = q_word(tile, kb, j, c);
                s += dot(q4x4(w), xs[xb + c]) + dot(q4x4(w >> 4), xs[xb + 4u + c]);
            }
#endif
            acc += q_scale(tile, kb, j) * s;
        }
    }
    const float sc = xin_scale();
    red[tid] = acc;
    barrier();
    for (uint s = LANES / 2u; s > 0u; s >>= 1) {
        if (lane < s) red[tid] += red[tid + 16u * s];
        barrier();
    }
    if (lane == 0u && r < rows) {
        const uint o = y_off + r;
        y[o] = (ACC != 0u ? y[o] : 0.0) + red[tid] * sc;
    }
}
