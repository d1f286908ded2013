// Matrix product of prefill, Y[t, y_off + r] (+)= sum_k X[t, k] W[r, k] for t < n, r < rows:
// X [n, K] f32 rows, W [rows, K] in the format WFMT (wfmt.glsl), Y rows of ldy floats;
// K a multiple of 8 (the last k slice is zero-padded when K is not one of BK).
// One workgroup per BM x BN tile of Y; the k loop stages a BK-deep slice of X and W in
// shared memory (transposed, so a thread's 4 rows and 4 columns are 4 consecutive floats),
// then each of the 256 threads adds its 4 x 4 outer products.
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint K = 256;    // row length, a multiple of 8
layout(constant_id = 1) const uint ACC = 0;    // 1: add into Y
#include "wfmt.glsl"
const uint BM = 64;
const uint BN = 64;
const uint BK = 16;
const uint KW = (WFMT == 0) ? K : K / 2;  // u32 words per weight row

layout(std430, set = 0, binding = 0) readonly buffer Wb { uint W[]; };
layout(std430, set = 0, binding = 1) readonly buffer Xb { float X[]; };
layout(std430, set = 0, binding = 2) buffer Yb { float Y[]; };

layout(push_constant) uniform Push {
    uint n;       // rows of X and Y
    uint rows;    // rows of this weight binding
    uint y_off;   // Y column of its row 0
    uint ldy;     // floats per Y row
} pc;

shared float xs[BK][BM];
shared float ws[BK][BN];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint t0 = gl_WorkGroupID.y * BM;
    const uint r0 = gl_WorkGroupID.x * BN;
    const uint tx = tid % 16u;   // columns r0 + 4 tx ..
    const uint ty = tid / 16u;   // rows t0 + 4 ty ..
    float acc[4][4];
    [[unroll]] for (uint i = 0; i < 4; ++i) [[unroll]] for (uint j = 0; j < 4; ++j) acc[i][j] = 0.0;
    for (uint k0 = 0; k0 < K; k0 += BK) {
        for (uint e = tid; e < BM * BK; e += 256u) {
            const uint tt = e / BK, kk = e % BK;
            const uint t = t0 + tt;
            xs[kk][tt] = (t < pc.n && k0 + kk < K) ? X[t * K + k0 + kk] : 0.0;
        }
        for (uint e = tid; e < BN * BK; e += 256u) {
            const uint rr = e / BK, kk = e % BK;
            const uint r = r0 + rr;
            float w = 0.0;
            if (r < pc.rows && k0 + kk < K) {
#if WFMT == 0
                w = wone(W[r * KW + k0 + kk], 0u);
#else
                const uint k = k0 + kk;
                w = wone(W[r * KW + k / 2u], k % 2u);
#endif
            }
            ws[kk][rr] = w;
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
