#version 450
// Forgetting-attention decode, pass 2 of 2: exact merge of the per-chunk partial softmaxes
//   M = max_c m_c,  L = sum_c l_c 2^(m_c - M),  o = sum_c o_c 2^(m_c - M) / L
// (log2 units, see decode.glsl). One workgroup per query; one thread per vec4 column.
// A query with no attended entry (L = 0) gets o = 0 and lse = -inf.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint D = 64;
const uint D4 = D / 4;
const float LOG2E = 1.4426950408889634;
const float NEG = -1.0e30;

layout(std430, set = 0, binding = 0) readonly buffer Hb { uvec4 qinfo[]; };  // [query]: entry0, n, chunk0, qpos
layout(std430, set = 0, binding = 1) readonly buffer Pm { vec2 part_ml[]; };
layout(std430, set = 0, binding = 2) readonly buffer Po { vec4 part_o[]; };
layout(std430, set = 0, binding = 3) writeonly buffer Ob { vec4 o[]; };       // [query][D]
layout(std430, set = 0, binding = 4) writeonly buffer Lb { float lse[]; };    // [query]

layout(push_constant) uniform Push {
    uint chunk;
    uint block;
    float scale_log2;
    uint chunks_per_query;
} pc;

void main() {
    const uint qi = gl_WorkGroupID.x;
    const uvec4 info = qinfo[qi];
    const uint n_chunks = (info.y + pc.chunk - 1u) / pc.chunk;
    const uint c0 = info.z;
    float mx = NEG;
    for (uint c = 0; c < n_chunks; ++c) mx = max(mx, part_ml[c0 + c].x);
    float lt = 0.0;
    for (uint c = 0; c < n_chunks; ++c) {
        const vec2 ml = part_ml[c0 + c];
        lt += ml.y * exp2(ml.x - mx);
    }
    const float inv = lt > 0.0 ? 1.0 / lt : 0.0;
    for (uint col = gl_LocalInvocationID.x; col < D4; col += gl_WorkGroupSize.x) {
        vec4 x = vec4(0.0);
        for (uint c = 0; c < n_chunks; ++c) {
            x += part_o[(c0 + c) * D4 + col] * exp2(part_ml[c0 + c].x - mx);
        }
        o[qi * D4 + col] = x * inv;
    }
    if (gl_LocalInvocationID.x == 0u) {
        lse[qi] = lt > 0.0 ? (mx + log2(lt)) / LOG2E : -1.0 / 0.0;
    }
}
