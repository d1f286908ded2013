// Several matrix-vector products of one input in one dispatch (decode's projections of a
// normed row): y[y_off_s + r] = sum_i W_s[r, i] x[i] for r < rows_s, for each weight
// binding s < SLOTS, W_s [rows_s, K] row-major in the format WFMT (wfmt.glsl). Workgroups
// first_s .. first_s + ceil(rows_s / TEAMS) - 1 run binding s with mv.glsl's row loop
// (teams of TPR threads per row, partials summed in shared memory), so every output is the
// sum mv.glsl computes, in the same order. Unused bindings have first_s = 0xffffffff.
// The input is read through xin.glsl (XIN 1: decode's attention norm fused in).
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WGS = 256;  // threads, a multiple of TPR
layout(constant_id = 1) const uint K = 256;    // row length, a multiple of 8
layout(constant_id = 2) const uint TPR = 32;   // threads per row, a power of two
#include "wfmt.glsl"
#include "act.glsl"
const uint RW = K / EPW;        // uvec4 per row
const uint TEAMS = WGS / TPR;
const uint UNR = 8u;            // row words in flight per lane
#define SLOTS 8

layout(std430, set = 0, binding = 0) readonly buffer Wb { uvec4 W[]; } wb[SLOTS];
layout(std430, set = 0, binding = 1) readonly buffer Xb { vec4 x[]; };
layout(std430, set = 0, binding = 2) writeonly buffer Yb { float y[]; };

layout(push_constant) uniform Push {
    uvec4 rows[SLOTS / 4];   // rows of each binding
    uvec4 y_off[SLOTS / 4];  // output index of its row 0
    uvec4 first[SLOTS / 4];  // its first workgroup
} pc;

shared float red[WGS];
#include "xin.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint team = tid / TPR;
    const uint lane = tid % TPR;
    const uint wg = gl_WorkGroupID.x;
    uint s = 0u;
    [[unroll]] for (uint i = 1u; i < SLOTS; ++i) {
        if (wg >= pc.first[i / 4u][i % 4u]) s = i;
    }
    const uint rows = pc.rows[s / 4u][s % 4u];
    const uint r = (wg - pc.first[s / 4u][s % 4u]) * TEAMS + team;
    xin_setup(0u);
    float acc = 0.0;
    if (r < rows) {
        // UNR words of the row in flight per lane: every load of a round issued before
        // its products (the same order of additions as one word at a time).
        for (uint c0 = lane; c0 < RW; c0 += TPR * UNR) {
            uvec4 wv[UNR];
            vec4 xa[UNR];
#if WFMT != 0
            vec4 xb[UNR];
#endif
            [[unroll]] for (uint u = 0u; u < UNR; ++u) {
                const uint c = min(c0 + u * TPR, RW - 1u);
                wv[u] = wb[s].W[r * RW + c];
#if WFMT == 0
                xa[u] = xin(0u, c);
#else
                xa[u] = xin(0u, 2u * c);
                xb[u] = xin(0u, 2u * c + 1u);
#endif
            }
            [[unroll]] for (uint u = 0u; u < UNR; ++u) {
                vec4 a, b;
                unpack8(wv[u], a, b);
#if WFMT == 0
                const float p = dot(a, xa[u]);
#else
                const float p = dot(a, xa[u]) + dot(b, xb[u]);
#endif
                if (c0 + u * TPR < RW) acc += p;
            }
        }
    }
    red[tid] = acc;
    barrier();
    for (uint k = TPR / 2u; k > 0u; k >>= 1) {
        if (lane < k) red[tid] += red[tid + k];
        barrier();
    }
    if (lane == 0u && r < rows) y[pc.y_off[s / 4u][s % 4u] + r] = red[tid];
}
