// Matrix-vector product of decode, y[y_off + r] (+)= sum_i W[r, i] x'[i] for r < rows:
// W [rows, K] row-major in the format WFMT (wfmt.glsl), x' the input read through xin.glsl
// (as stored, RMS-normed, or the gated activation), staged once per workgroup in shared
// memory. Teams of TPR threads share a row: lane l reads uvec4 words l, l + TPR, ... of it
// (one coalesced 16-byte load per lane, UNR of them in flight, the first round issued
// before the input is staged), then the team sums its partials in shared memory.
// Memory-bound: each weight is read once.
// With MULTI defined, several matrices of one input in one dispatch (decode's projections
// of a normed row): weight bindings s < SLOTS, workgroups first_s .. first_s +
// ceil(rows_s / TEAMS) - 1 run binding s (unused bindings: first_s = 0xffffffff), the input
// at float 0, no ACC.
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

#ifdef MULTI
#define SLOTS 8
layout(std430, set = 0, binding = 0) readonly buffer Wb { uvec4 W[]; } wb[SLOTS];
uint wslot = 0u;
#define W wb[wslot].W
#else
layout(std430, set = 0, binding = 0) readonly buffer Wb { uvec4 W[]; };
#endif
layout(std430, set = 0, binding = 1) readonly buffer Xb { vec4 x[]; };
layout(std430, set = 0, binding = 2) buffer Yb { float y[]; };

#ifdef MULTI
layout(push_constant) uniform Push {
    uvec4 rows[SLOTS / 4];   // rows of each binding
    uvec4 y_off[SLOTS / 4];  // output index of its row 0
    uvec4 first[SLOTS / 4];  // its first workgroup
} pc;
#else
layout(push_constant) uniform Push {
    uint rows;    // rows of this weight binding
    uint y_off;   // output index of its row 0
    uint x_off4;  // input offset in vec4
} pc;
#endif

shared float red[WGS];
#include "xin.glsl"

// Words c0, c0 + TPR, ... (UNR of them, clamped to the tile's nw words from w0) of row r.
void load_round(uint r, uint w0, uint nw, uint c0, inout uvec4 wv[UNR]) {
    [[unroll]] for (uint u = 0u; u < UNR; ++u) {
        wv[u] = W[r * RW + w0 + min(c0 + u * TPR, nw - 1u)];
    }
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint team = tid / TPR;
    const uint lane = tid % TPR;
#ifdef MULTI
    uint s = 0u;
    [[unroll]] for (uint i = 1u; i < SLOTS; ++i) {
        if (gl_WorkGroupID.x >= pc.first[i / 4u][i % 4u]) s = i;
    }
    wslot = s;
    const uint rows = pc.rows[s / 4u][s % 4u];
    const uint y_off = pc.y_off[s / 4u][s % 4u];
    const uint r = (gl_WorkGroupID.x - pc.first[s / 4u][s % 4u]) * TEAMS + team;
    const uint x_off4 = 0u;
#else
    const uint rows = pc.rows;
    const uint y_off = pc.y_off;
    const uint r = gl_WorkGroupID.x * TEAMS + team;
    const uint x_off4 = pc.x_off4;
#endif
    const bool live = r < rows;
    float acc = 0.0;
    uvec4 wv[UNR];
    // Tiles of XT input vec4 (XT a multiple of 2: whole row words).
    for (uint t0 = 0u; t0 < K / 4u; t0 += XT) {
        const uint n = min(XT, K / 4u - t0);
        const uint w0 = t0 * 4u / EPW, nw = n * 4u / EPW;
        if (live) load_round(r, w0, nw, lane, wv);
        if (t0 > 0u) barrier();
        xin_stage(x_off4, t0, n);
        if (live) {
            for (uint c0 = lane; c0 < nw; c0 += TPR * UNR) {
                if (c0 != lane) load_round(r, w0, nw, c0, wv);
                [[unroll]] for (uint u = 0u; u < UNR; ++u) {
                    const uint c = min(c0 + u * TPR, nw - 1u);
                    vec4 a, b;
                    unpack8(wv[u], a, b);
#if WFMT == 0
                    const float p = dot(a, xs[c]);
#else
                    const float p = dot(a, xs[2u * c]) + dot(b, xs[2u * c + 1u]);
#endif
                    if (c0 + u * TPR < nw) acc += p;
                }
            }
        }
    }
    const float sc = xin_scale();
    red[tid] = acc;
    barrier();
    for (uint k = TPR / 2u; k > 0u; k >>= 1) {
        if (lane < k) red[tid] += red[tid + k];
        barrier();
    }
    if (lane == 0u && live) {
        const uint o = y_off + r;
        y[o] = (ACC != 0u ? y[o] : 0.0) + red[tid] * sc;
    }
}
