#version 450
// Embedding gather: h[t, :] = E[ids[t] - id0, :] for the tokens whose id lies in this
// binding's rows [id0, id0 + rows) (a table larger than one binding comes in row chunks).
// E rows of D weights in the format FMT (0 f32, 1 f16, 2 bf16; as in wfmt.glsl).
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint D = 256;
layout(constant_id = 1) const uint FMT = 0;

layout(std430, set = 0, binding = 0) readonly buffer Eb { uint E[]; };
layout(std430, set = 0, binding = 1) readonly buffer Ib { uint ids[]; };
layout(std430, set = 0, binding = 2) writeonly buffer Hb { float h[]; };

layout(push_constant) uniform Push {
    uint id0;
    uint rows;
} pc;

void main() {
    const uint t = gl_WorkGroupID.x;
    const uint id = ids[t];
    if (id < pc.id0 || id - pc.id0 >= pc.rows) return;
    const uint r = id - pc.id0;
    for (uint i = gl_LocalInvocationID.x; i < D; i += 64u) {
        float v;
        if (FMT == 0u) {
            v = uintBitsToFloat(E[r * D + i]);
        } else {
            const uint w = E[(r * D + i) / 2u];
            const uint hi = i % 2u;
            v = FMT == 1u ? unpackHalf2x16(w)[hi]
                          : uintBitsToFloat(hi == 0u ? w << 16 : w & 0xffff0000u);
        }
        h[t * D + i] = v;
    }
}
