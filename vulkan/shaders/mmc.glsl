// Matrix product of prefill on cooperative matrices (VK_KHR_cooperative_matrix), every
// weight format (set WFMT 0 f32, 1 f16, 2 bf16 (wfmt.glsl) or QFMT 8 Q8, 4 Q4 (qblk.glsl)):
//   Y[t, y_off + r] (+)= sum_k X[t, k] W[r, k]   for t < n, r < rows,
// X [n, K] f32 rows, W [rows, K], Y rows of ldy floats; K a multiple of 8 (of 32 for Q8 / Q4).
// X and W are rounded to f16 as they are staged (relative error <= 2^-11 per factor inside
// f16's normal range, |v| in [2^-14, 65504]); products accumulate in f32.
// A workgroup of 4 subgroups owns a BM x BN tile of Y (BM = 64 tokens, BN = 32 FN rows);
// subgroup (sm, sn) = (sg % 2, sg / 2) owns 32 tokens x 16 FN rows: 2 x FN 16x16x16 f16
// products into f32 accumulators per 16-deep k step. The k loop stages a BK = 32 slice of
// X and W (Q8 / Q4: one block, dequantized, w = d q) in shared memory as f16, row-major
// (X: token rows; W: weight rows, so the B operand W^T loads column-major); the output
// leaves through a per-subgroup 16 x 16 f32 buffer, bounds-checked.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 3) in;                // 4 subgroups
layout(constant_id = 0) const uint K = 256;    // row length
layout(constant_id = 1) const uint ACC = 0;    // 1: add into Y
layout(constant_id = 2) const uint FN = 4;     // 16-row fragments per subgroup: 2 or 4
const uint BM = 64u;
const uint BN = 32u * FN;
const uint BK = 32u;
const uint ST = BK + 8u;   // halves per staged row (80 bytes: 16-byte aligned rows)
const uint OST = 20u;      // floats per row of a subgroup's output buffer

#ifdef QFMT
layout(std430, set = 0, binding = 0) readonly buffer Wb { uint W[]; };
#if QFMT == 8
const uint QW = 8u;
#else
const uint QW = 4u;
#endif
#include "qblk.glsl"
const uint GW = ((K + 63u) / 64u) * TILE_W;  // words of a row group
#else
#include "wfmt.glsl"
layout(std430, set = 0, binding = 0) readonly buffer Wb { uvec4 W[]; };
#endif
layout(std430, set = 0, binding = 1) readonly buffer Xb { vec4 X[]; };
layout(std430, set = 0, binding = 2) buffer Yb { float Y[]; };

layout(push_constant) uniform Push {
    uint n;       // rows of X and Y
    uint rows;    // rows of this weight binding
    uint y_off;   // Y column of its row 0
    uint ldy;     // floats per Y row
} pc;

shared float16_t xh[BM * ST];   // xh[t][k]
shared float16_t wh[BN * ST];   // wh[r][k]
shared float osh[4u * 16u * OST];

#define F16A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define F16B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define F32M coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

void put_x(uint at, vec4 v) { [[unroll]] for (uint i = 0; i < 4u; ++i) xh[at + i] = float16_t(v[i]); }
void put_w(uint at, vec4 v) { [[unroll]] for (uint i = 0; i < 4u; ++i) wh[at + i] = float16_t(v[i]); }

// X[t0 .., k0 .. k0 + 32] into xh (zeros past n and K).
void stage_x(uint t0, uint k0) {
    for (uint e = gl_LocalInvocationIndex; e < BM * 8u; e += gl_WorkGroupSize.x) {
        const uint tt = e / 8u, c = e % 8u;
        const uint t = t0 + tt, k = k0 + 4u * c;
        put_x(tt * ST + 4u * c, (t < pc.n && k < K) ? X[(t * K + k) / 4u] : vec4(0.0));
    }
}

// W[r0 .., k0 .. k0 + 32] into wh (zeros past rows and K).
void stage_w(uint r0, uint k0) {
#ifdef QFMT
    const uint kb = k0 / 32u;
    for (uint e = gl_LocalInvocationIndex; e < BN * QW; e += gl_WorkGroupSize.x) {
        const uint j = e % 16u, c = (e / 16u) % QW, gi = e / (16u * QW);
        const uint rr = 16u * gi + j, r = r0 + rr;
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
        put_w(rr * ST + 4u * c, lo);
#if QFMT != 8
        put_w(rr * ST + 16u + 4u * c, hi);
#endif
    }
#else
    const uint PER = BK / EPW;  // uvec4s per row of the slice
    const uint KW4 = K / EPW;   // uvec4s per weight row
    for (uint e = gl_LocalInvocationIndex; e < BN * PER; e += gl_WorkGroupSize.x) {
        const uint rr = e / PER, c = e % PER;
        const uint r = r0 + rr, k = k0 + EPW * c;
        vec4 a = vec4(0.0), b = vec4(0.0);
        if (r < pc.rows && k < K) unpack8(W[r * KW4 + k / EPW], a, b);
        put_w(rr * ST + EPW * c, a);
        if (EPW == 8u) put_w(rr * ST + EPW * c + 4u, b);
    }
#endif
}

void main() {
#if defined(QFMT) && QFMT == 4
    load_levels();
#endif
    const uint sg = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint sgs = gl_SubgroupSize;
    const uint t0 = gl_WorkGroupID.y * BM;
    const uint r0 = gl_WorkGroupID.x * BN;
    const uint mb = 32u * (sg % 2u);    // the subgroup's first token of the tile
    const uint nb = 16u * FN * (sg / 2u);  // its first weight row of the tile
    F32M acc[2][FN];
    [[unroll]] for (uint i = 0; i < 2u; ++i)
        [[unroll]] for (uint j = 0; j < FN; ++j) acc[i][j] = F32M(0.0);
    for (uint k0 = 0; k0 < K; k0 += BK) {
        stage_x(t0, k0);
        stage_w(r0, k0);
        barrier();
        [[unroll]] for (uint kk = 0; kk < BK; kk += 16u) {
            F16A a[2];
            [[unroll]] for (uint i = 0; i < 2u; ++i)
                coopMatLoad(a[i], xh, (mb + 16u * i) * ST + kk, ST, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0; j < FN; ++j) {
                F16B b;
                coopMatLoad(b, wh, (nb + 16u * j) * ST + kk, ST, gl_CooperativeMatrixLayoutColumnMajor);
                [[unroll]] for (uint i = 0; i < 2u; ++i) acc[i][j] = coopMatMulAdd(a[i], b, acc[i][j]);
            }
        }
        barrier();
    }
    const uint ob = sg * 16u * OST;
    [[unroll]] for (uint i = 0; i < 2u; ++i) {
        [[unroll]] for (uint j = 0; j < FN; ++j) {
            coopMatStore(acc[i][j], osh, ob, OST, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint e = lane; e < 256u; e += sgs) {
                const uint t = t0 + mb + 16u * i + e / 16u;
                const uint r = r0 + nb + 16u * j + e % 16u;
                if (t < pc.n && r < pc.rows) {
                    const uint o = t * pc.ldy + pc.y_off + r;
                    Y[o] = (ACC != 0u ? Y[o] : 0.0) + osh[ob + (e / 16u) * OST + e % 16u];
                }
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();
        }
    }
}
