#version 450
// attn_pre.glsl over a chunk of n tokens: one workgroup per (token t, head h).
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint H = 4;
layout(constant_id = 1) const uint HD = 64;
layout(constant_id = 2) const uint KSHIFT = 1;
layout(constant_id = 3) const uint VSHIFT = 1;
layout(constant_id = 4) const uint QKN = 1;    // 0 none, 1 one weight per head, 2 shared
#include "act.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Pb { float P[]; };
layout(std430, set = 0, binding = 1) readonly buffer Sb { float state[]; };   // [k_raw D | v_raw D] of the token before
layout(std430, set = 0, binding = 2) readonly buffer Nb { float nw[]; };      // [q_norm | k_norm] (D or HD each)
layout(std430, set = 0, binding = 3) readonly buffer Gb { float fbias[]; };   // [H]
layout(std430, set = 0, binding = 4) writeonly buffer Qb { float qo[]; };     // [H][n][HD]
layout(std430, set = 0, binding = 5) writeonly buffer Kb { float kx[]; };
layout(std430, set = 0, binding = 6) writeonly buffer Vb { float vx[]; };
layout(std430, set = 0, binding = 7) writeonly buffer Lb { float lf[]; };     // [n][H]
layout(std430, set = 0, binding = 8) writeonly buffer Rb { vec2 nrm[]; };     // [n][H]

layout(push_constant) uniform Push {
    uint n;
    float qk_eps;
} pc;

#include "attn_pre.glsl"

void main() { attn_pre_row(gl_WorkGroupID.x, gl_WorkGroupID.y, pc.n, pc.qk_eps); }
