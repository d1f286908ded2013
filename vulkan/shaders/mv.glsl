// Matrix-vector product of decode, y[y_off + r] (+)= sum_i W[r, i] x[x_off + i] for r < rows:
// W [rows, K] row-major in the format WFMT (wfmt.glsl). Teams of TPR threads share a row:
// lane l reads uvec4 words l, l + TPR, ... of it (one coalesced 16-byte load per lane),
// then the team sums its partials in shared memory. Memory-bound: each weight is read once.
// The input is read through xin.glsl (XIN: as stored, RMS-normed, or the gated activation).
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WGS = 256;  // threads, a multiple of TPR
layout(constant_id = 1) const uint K = 256;    // row length, a multiple of 8
layout(constant_id = 2) const uint TPR = 32;   // threads per row, a power of two
layout(constant_id = 3) const uint ACC = 0;    // 1: add into y
#include "wfmt.glsl"
#include "act.glsl"
const uint RW = K / EPW;        // uvec4 per row
const uint TEAMS = WGS / TPR;
const uint UNR = 8u;            // row words in flight per lane

layout(std430, set = 0, binding = 0) readonly buffer Wb { uvec4 W[]; };
layout(std430, set = 0, binding = 1) readonly buffer Xb { vec4 x[]; };
layout(std430, set = 0, binding = 2) buffer Yb { float y[]; };

layout(push_constant) uniform Push {
    uint rows;    // rows of this weight binding
    uint y_off;   // output index of its row 0
    uint x_off4;  // input offset in vec4
} pc;

shared float red[WGS];
#include "xin.glsl"

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint team = tid / TPR;
    const uint lane = tid % TPR;
    const uint r = gl_WorkGroupID.x * TEAMS + team;
    xin_setup(pc.x_off4);
    float acc = 0.0;
    if (r < pc.rows) {
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
                wv[u] = W[r * RW + c];
#if WFMT == 0
                xa[u] = xin(pc.x_off4, c);
#else
                xa[u] = xin(pc.x_off4, 2u * c);
                xb[u] = xin(pc.x_off4, 2u * c + 1u);
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
    for (uint s = TPR / 2u; s > 0u; s >>= 1) {
        if (lane < s) red[tid] += red[tid + s];
        barrier();
    }
    if (lane == 0u && r < pc.rows) {
        const uint o = pc.y_off + r;
        y[o] = (ACC != 0u ? y[o] : 0.0) + red[tid];
    }
}
