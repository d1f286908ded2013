#version 450
// The MLP's gated activation (spec section 3.9): a[t, i] = act(gu[t, i]) * gu[t, I + i],
// act = SiLU (ACT 0) or sigmoid (ACT 1); gu rows of 2I floats, a rows of I.
#extension GL_GOOGLE_include_directive : require
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint I = 768;
layout(constant_id = 1) const uint ACT = 0;
#include "act.glsl"

layout(std430, set = 0, binding = 0) readonly buffer Gb { float gu[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Ab { float a[]; };

layout(push_constant) uniform Push {
    uint n;
} pc;

void main() {
    const uint e = gl_GlobalInvocationID.x;
    if (e >= pc.n * I) return;
    const uint t = e / I, i = e % I;
    const float g = gu[t * 2u * I + i];
    a[e] = (ACT == 0u ? silu_(g) : sigmoid_(g)) * gu[t * 2u * I + I + i];
}
