#version 450
// Host-to-device uploads in one dispatch per SLOTS destination buffers, instead of one copy
// command per buffer: workgroup i copies region pc.base + i, `words` u32 from the staging
// buffer at `src` to destination slot `slot` at `dst`. The host splits regions into pieces
// of at most a few thousand words and gives each dispatch a source window under the
// device's binding limit.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WGS = 256;
#define SLOTS 16

layout(std430, set = 0, binding = 0) readonly buffer Src { uint src[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Dst { uint x[]; } dst[SLOTS];
layout(std430, set = 0, binding = 2) readonly buffer Rg { uvec4 region[]; };  // (slot, src, dst, words)

layout(push_constant) uniform Push {
    uint base;
} pc;

void main() {
    uvec4 r = region[pc.base + gl_WorkGroupID.x];
    for (uint i = gl_LocalInvocationID.x; i < r.w; i += WGS) {
        dst[r.x].x[r.z + i] = src[r.y + i];
    }
}
