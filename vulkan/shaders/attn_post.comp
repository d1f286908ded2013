#version 450
// The attention output of one block before o_proj (spec section 3.7), one workgroup per
// (token t, head h): o' = GroupRMSNorm(o; w, eps) (NORM) times act(x.Wg) (GATE: 1 sigmoid,
// 2 SiLU). Reads o head-major [H][n][HD] (the attention kernels' layout), writes o' [n][D].
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint H = 4;
layout(constant_id = 1) const uint HD = 64;
layout(constant_id = 2) const uint NORM = 1;
layout(constant_id = 3) const uint GATE = 1;
#include "act.glsl"
const uint D = H * HD;
const uint PW = 4u * D + 3u * H;   // projection row: the gate logits at 3D + 3H

layout(std430, set = 0, binding = 0) readonly buffer Ob { float o[]; };
layout(std430, set = 0, binding = 1) readonly buffer Pb { float P[]; };
layout(std430, set = 0, binding = 2) readonly buffer Wb { float w[]; };   // [D]
layout(std430, set = 0, binding = 3) writeonly buffer Yb { float y[]; };  // [n][D]

layout(push_constant) uniform Push {
    uint n;
    float eps;
} pc;

shared float red[64];

void main() {
    const uint t = gl_WorkGroupID.x;
    const uint h = gl_WorkGroupID.y;
    const uint tid = gl_LocalInvocationID.x;
    const uint base = (h * pc.n + t) * HD;
    float s = 0.0;
    for (uint i = tid; i < HD; i += 64u) s += o[base + i] * o[base + i];
    red[tid] = s;
    barrier();
    for (uint k = 32u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    const float r = NORM != 0u ? 1.0 / sqrt(red[0] / float(HD) + pc.eps) : 1.0;
    for (uint i = tid; i < HD; i += 64u) {
        const uint c = h * HD + i;
        float v = o[base + i];
        if (NORM != 0u) v = v * r * w[c];
        if (GATE != 0u) {
            const float g = P[t * PW + 3u * D + 3u * H + c];
            v *= GATE == 1u ? sigmoid_(g) : silu_(g);
        }
        y[t * D + c] = v;
    }
}
