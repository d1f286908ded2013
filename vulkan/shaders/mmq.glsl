// Matrix product of prefill for block-format weights (QFMT 8: Q8, 4: Q4; qblk.glsl),
// Y[t, y_off + r] (+)= sum_k X[t, k] W[r, k] for t < n, r < rows: X [n, K] f32 rows,
// W [rows, K], Y rows of ldy floats; K a multiple of 32.
// One workgroup per BM x BN tile of Y; the k loop takes one block (BK = 32) at a time: it
// stages the X slice and the block's weights of the BN rows, dequantized (w = d q, exact in
// f32), in shared memory (transposed, so a thread's 4 rows and 4 columns are 4 consecutive
// floats), then each of the 256 threads adds its 4 x 4 outer products in f32.
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint K = 256;    // row length, a multiple of 32
layout(constant_id = 1) const uint ACC = 0;    // 1: add into Y

layout(std430, set = 0, binding = 0) readonly buffer Wb { uint W[]; };
layout(std430, set = 0, binding = 1) readonly buffer Xb { float X[]; };
layout(std430, set = 0, binding = 2) buffer Yb { float Y[]; };

#if QFMT == 8
const uint QW = 8u;
#else
const uint QW = 4u;
#endif
#include "qblk.glsl"
const uint BM = 64;
const uint BN = 64;                          // 4 row groups
const uint BK = 32;                          // one block
const uint NB = K / 32u;
const uint GW = ((K + 63u) / 64u) * TILE_W;  // words of a row group

layout(push_constant) uniform Push {
    uint n;       // rows of X and Y
    uint rows;    // rows of this weight binding
    uint y_off;   // Y column of its row 0
    uint ldy;     // floats per Y row
} pc;

shared float xs[BK][BM];
shared float ws[BK][BN];

void main() {
    load_levels();
    const uint tid = gl_LocalInvocationID.x;
    const uint t0 = gl_WorkGroupID.y * BM;
    const uint r0 = gl_WorkGroupID.x * BN;
    const uint tx = tid % 16u;   // columns r0 + 4 tx ..
    const uint ty = tid / 16u;   // rows t0 + 4 ty ..
    float acc[4][4];
    [[unroll]] for (uint i = 0; i < 4; ++i) [[unroll]] for (uint j = 0; j < 4; ++j) acc[i][j] = 0.0;
    for (uint kb = 0; kb < NB; ++kb) {
        const uint k0 = kb * BK;
        for (uint e = tid; e < BM * BK; e += 256u) {
            const uint tt = e / BK, kk = e % BK;
            const uint t = t0 + tt;
            xs[kk][tt] = t < pc.n ? X[t * K + k0 + kk] : 0.0;
        }
        // Word c of row j of group gi: weights 4c.. (Q8), 4c.. and 16+4c.. (Q4).
        for (uint e = tid; e < 4u * 16u * QW; e += 256u) {
            const uint j = e % 16u, c = (e / 16u) % QW, gi = e / (16u * QW);
            const uint rr = 16u * gi + j;
            const uint r = r0 + rr;
            vec4 lo = vec4(0.0), hi = vec4(0.0);
            if (r < pc.rows) {
                const uint tile = q_tile(GW, r / 16u, kb);
                const float d = q_scale(tile, kb, j);
                const uint w = q_word(tile, kb, j, c);
#if QFMT == 8
                lo = d * q8x4(w);
#else
                lo = d * q4x4(w);
                hi = d * q4x4(w >> 4);
#endif
            }
            [[unroll]] for (uint t = 0; t < 4u; ++t) {
                ws[4u * c + t][rr] = lo[t];
#if QFMT != 8
                ws[16u + 4u * c + t][rr] = hi[t];
#endif
            }
        }
        barrier();
        [[unroll]] for (uint kk = 0; kk < BK; ++kk) {
            float a[4], b[4];
            [[unroll]] for (uint i = 0; i < 4; ++i) a[i] = xs[kk][4u * ty + i];
            [[unroll]] for (uint j = 0; j < 4; ++j) b[j] = ws[kk][4u * tx + j];
            [[unroll]] for (uint i = 0; i < 4; ++i)
                [[unroll]] for (uint j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        barrier();
    }
    [[unroll]] for (uint i = 0; i < 4; ++i) {
        const uint t = t0 + 4u * ty + i;
        if (t >= pc.n) continue;
        [[unroll]] for (uint j = 0; j < 4; ++j) {
            const uint r = r0 + 4u * tx + j;
            if (r >= pc.rows) continue;
            const uint o = t * pc.ldy + pc.y_off + r;
            Y[o] = (ACC != 0u ? Y[o] : 0.0) + acc[i][j];
        }
    }
}
