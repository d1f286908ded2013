// Register-tiled matrix product of prefill, every weight format (set WFMT 0 f32, 1 f16,
// 2 bf16 (wfmt.glsl) or QFMT 8 Q8, 4 Q4 (qblk.glsl) before including):
//   Y[t, y_off + r] (+)= sum_k X[t, k] W[r, k]   for t < n, r < rows,
// X [n, K] f32 rows, W [rows, K], Y rows of ldy floats; K a multiple of 8 (of 32 for Q8 / Q4).
// One workgroup of 256 threads (16 x 16) per BM x BN tile of Y, BM = 16 TM tokens and
// BN = 16 TN weight rows; thread (tx, ty) owns TM x TN outputs: tokens t0 + 64 g + 4 ty + i
// and rows r0 + 64 g + 4 tx + j (g a 64-wide group, i, j < 4), so its reads of a k row of
// the tile are vec4s of consecutive columns. The k loop stages a BK = 16 slice: X as vec4
// loads along k, W as uvec4 loads (Q8 / Q4: half a block, dequantized, w = d q exact in
// f32), both transposed into shared memory k-major; then every thread adds its TM x TN
// outer products in f32, k in order (so each output is the same f32 sum of K products, in
// the order of k, as a sequential loop). The next slice's global loads are issued before
// these products and land in registers, stored to shared memory after the slice's barrier.
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint K = 256;    // row length
layout(constant_id = 1) const uint ACC = 0;    // 1: add into Y
layout(constant_id = 2) const uint TM = 8;     // tokens per thread: 4 or 8
layout(constant_id = 3) const uint TN = 8;     // weight rows per thread: 4 or 8
const uint BM = 16u * TM;
const uint BN = 16u * TN;
const uint BK = 16u;
const uint XS = BM + 4u;   // floats per k row of xs (the pad spreads the transposed stores)
const uint WS = BN + 4u;

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

shared vec4 xs[BK * XS / 4u];   // xs[k][t]: float k XS + t
shared vec4 ws[BK * WS / 4u];   // ws[k][r]: float k WS + r

void put_x(uint k, uint t, float v) { xs[(k * XS + t) / 4u][t % 4u] = v; }
void put_w(uint k, uint r, float v) { ws[(k * WS + r) / 4u][r % 4u] = v; }

// A thread's share of one k slice, held in registers from its fetch (global loads issued
// before the previous slice's products) to its store in shared memory.
const uint NX = TM / 4u;   // vec4s of X (BM * 4 / 256)
vec4 xr[NX];
#ifdef QFMT
const uint NW = TN / 4u;   // words of W (BN * 4 / 256) and their block scales
uint wr[NW];
float wd[NW];
#else
const uint PER = 16u / EPW;               // uvec4s per weight row of the slice
const uint NW = (BN * PER + 255u) / 256u;
const uint KW4 = K / EPW;                 // uvec4s per weight row
uvec4 wr[NW];
#endif

// X[t0 .., k0 .. k0 + 16] and W[r0 .., k0 .. k0 + 16] into registers (zeros past n, rows, K).
void fetch(uint t0, uint r0, uint k0) {
    const uint tid = gl_LocalInvocationIndex;
    [[unroll]] for (uint s = 0; s < NX; ++s) {
        const uint e = tid + 256u * s;
        const uint tt = e / 4u, c = e % 4u;
        const uint t = t0 + tt, k = k0 + 4u * c;
        xr[s] = (t < pc.n && k < K) ? X[(t * K + k) / 4u] : vec4(0.0);
    }
#ifdef QFMT
    // Half h of block kb: Q8 words 4h + c; Q4 words c (their low or high nibbles).
    const uint kb = k0 / 32u, h = (k0 / 16u) % 2u;
    [[unroll]] for (uint s = 0; s < NW; ++s) {
        const uint e = tid + 256u * s;
        const uint j = e % 16u, c = (e / 16u) % 4u, gi = e / 64u;
        const uint r = r0 + 16u * gi + j;
        wr[s] = 0u;
        wd[s] = 0.0;
        if (r < pc.rows) {
            const uint tile = q_tile(GW, r / 16u, kb);
            wd[s] = q_scale(tile, kb, j);
            wr[s] = q_word(tile, kb, j, QFMT == 8 ? 4u * h + c : c);
        }
    }
#else
    [[unroll]] for (uint s = 0; s < NW; ++s) {
        const uint e = tid + 256u * s;
        const uint rr = e / PER, c = e % PER;
        const uint r = r0 + rr, k = k0 + EPW * c;
        wr[s] = (e < BN * PER && r < pc.rows && k < K) ? W[r * KW4 + k / EPW] : uvec4(0u);
    }
#endif
}

// The fetched slice (at k0) into xs and ws, W as f32 (Q8 / Q4: w = d q).
void store(uint k0) {
    const uint tid = gl_LocalInvocationIndex;
    [[unroll]] for (uint s = 0; s < NX; ++s) {
        const uint e = tid + 256u * s;
        const uint tt = e / 4u, c = e % 4u;
        [[unroll]] for (uint i = 0; i < 4u; ++i) put_x(4u * c + i, tt, xr[s][i]);
    }
#ifdef QFMT
    const uint h = (k0 / 16u) % 2u;
    [[unroll]] for (uint s = 0; s < NW; ++s) {
        const uint e = tid + 256u * s;
        const uint j = e % 16u, c = (e / 16u) % 4u, gi = e / 64u;
#if QFMT == 8
        const vec4 v = wd[s] * q8x4(wr[s]);
#else
        const vec4 v = wd[s] * q4x4(wr[s] >> (4u * h));
#endif
        [[unroll]] for (uint i = 0; i < 4u; ++i) put_w(4u * c + i, 16u * gi + j, v[i]);
    }
#else
    [[unroll]] for (uint s = 0; s < NW; ++s) {
        const uint e = tid + 256u * s;
        if (e >= BN * PER) continue;
        const uint rr = e / PER, c = e % PER;
        vec4 a, b;
        unpack8(wr[s], a, b);
        [[unroll]] for (uint i = 0; i < 4u; ++i) put_w(EPW * c + i, rr, a[i]);
        if (EPW == 8u) {
            [[unroll]] for (uint i = 0; i < 4u; ++i) put_w(EPW * c + 4u + i, rr, b[i]);
        }
    }
#endif
}

void main() {
#if defined(QFMT) && QFMT == 4
    load_levels();
#endif
    const uint tid = gl_LocalInvocationIndex;
    const uint t0 = gl_WorkGroupID.y * BM;
    const uint r0 = gl_WorkGroupID.x * BN;
    const uint tx = tid % 16u, ty = tid / 16u;
    float acc[TM][TN];
    [[unroll]] for (uint i = 0; i < TM; ++i) [[unroll]] for (uint j = 0; j < TN; ++j) acc[i][j] = 0.0;
    fetch(t0, r0, 0u);
    for (uint k0 = 0; k0 < K; k0 += BK) {
        store(k0);
        barrier();
        if (k0 + BK < K) fetch(t0, r0, k0 + BK);
        [[unroll]] for (uint kk = 0; kk < BK; ++kk) {
            vec4 a[TM / 4u], b[TN / 4u];
            [[unroll]] for (uint g = 0; g < TM / 4u; ++g) a[g] = xs[(kk * XS + 64u * g) / 4u + ty];
            [[unroll]] for (uint g = 0; g < TN / 4u; ++g) b[g] = ws[(kk * WS + 64u * g) / 4u + tx];
            [[unroll]] for (uint i = 0; i < TM; ++i)
                [[unroll]] for (uint j = 0; j < TN; ++j)
                    acc[i][j] = fma(a[i / 4u][i % 4u], b[j / 4u][j % 4u], acc[i][j]);
        }
        barrier();
    }
    [[unroll]] for (uint i = 0; i < TM; ++i) {
        const uint t = t0 + 64u * (i / 4u) + 4u * ty + i % 4u;
        if (t >= pc.n) continue;
        [[unroll]] for (uint j = 0; j < TN; ++j) {
            const uint r = r0 + 64u * (j / 4u) + 4u * tx + j % 4u;
            if (r >= pc.rows) continue;
            const uint o = t * pc.ldy + pc.y_off + r;
            Y[o] = (ACC != 0u ? Y[o] : 0.0) + acc[i][j];
        }
    }
}
