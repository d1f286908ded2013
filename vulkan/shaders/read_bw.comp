#version 450
// Read-bandwidth probe: every invocation sums the vec4s of `src` at its grid-stride
// positions and writes one float, so reading `n4` vec4s is the whole cost (the write is one
// float per invocation).
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Sb { vec4 src[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Ob { float outv[]; };

layout(push_constant) uniform Push {
    uint n4;
} pc;

void main() {
    const uint gid = gl_GlobalInvocationID.x;
    const uint stride = gl_NumWorkGroups.x * 256u;
    vec4 acc = vec4(0.0);
    for (uint i = gid; i < pc.n4; i += stride) {
        acc += src[i];
    }
    outv[gid] = acc.x + acc.y + acc.z + acc.w;
}
