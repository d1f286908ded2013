// Forgetting-attention decode, split over the cache (flash-decoding), pass 1 of 2.
//
// One workgroup per (query, chunk of CHUNK cache entries). Each thread runs an online
// softmax over entries tid, tid + WG, ... of the chunk's kept blocks:
//   w_j = exp(s q.k_j + c_t - c_j),  m = max log2 w,  l = sum 2^(log2 w - m),  o = sum 2^(.) v_j
// then the workgroup merges its threads exactly (rescale to the common max) and writes
// one partial (m, l, o[D]) per chunk. decode_merge.comp merges the chunks.
// c is a double-float pair per entry/query (see prefill.glsl). Entries are in any order;
// `pos` masks entries newer than the query when a step has several queries.
#extension GL_EXT_control_flow_attributes : enable
#if STORAGE_F16
#extension GL_EXT_shader_16bit_storage : require
#define SVEC4 f16vec4
#else
#define SVEC4 vec4
#endif
#if USE_SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WGS = 128;  // power of two
layout(constant_id = 1) const uint D = 64;
const uint D4 = D / 4;
const float LOG2E = 1.4426950408889634;
const float NEG = -1.0e30;

layout(std430, set = 0, binding = 0) readonly buffer Qb { vec4 q[]; };      // [query][D], always f32
layout(std430, set = 0, binding = 1) readonly buffer Kb { SVEC4 k[]; };     // [entry][D]
layout(std430, set = 0, binding = 2) readonly buffer Vb { SVEC4 v[]; };     // [entry][D]
layout(std430, set = 0, binding = 3) readonly buffer Cb { vec2 ce[]; };     // [entry] (hi, lo)
layout(std430, set = 0, binding = 4) readonly buffer Ib { int epos[]; };    // [entry] position - query base
layout(std430, set = 0, binding = 5) readonly buffer Hb { uvec4 qinfo[]; }; // [query]: entry0, n, chunk0, qpos
layout(std430, set = 0, binding = 6) readonly buffer Qc { vec2 qc[]; };     // [query] (hi, lo)
layout(std430, set = 0, binding = 7) readonly buffer Kp { uint kept[]; };   // [block] 1 = attend
layout(std430, set = 0, binding = 8) writeonly buffer Pm { vec2 part_ml[]; }; // [chunk] (m, l)
layout(std430, set = 0, binding = 9) writeonly buffer Po { vec4 part_o[]; };  // [chunk][D]

layout(push_constant) uniform Push {
    uint chunk;       // entries per chunk, multiple of block
    uint block;       // entries per ACP block
    float scale_log2; // sm_scale * log2(e)
    uint chunks_per_query;
} pc;

#if USE_SUBGROUP
const uint MAX_SG = 64;          // host guarantees WGS / subgroup size <= MAX_SG
shared vec4 sg_o[MAX_SG * D4];   // [subgroup][D4]
shared float sg_m[MAX_SG];
shared float sg_l[MAX_SG];
#else
shared float red_m[WGS];
shared float red_l[WGS];
shared vec4 red_o[WGS];
#endif

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint WG = WGS;
    const uint qi = gl_WorkGroupID.y;
    const uint ch = gl_WorkGroupID.x;
    const uvec4 info = qinfo[qi];
    const uint e0 = info.x, n = info.y, qpos = info.w;
    const uint out_idx = info.z + ch;
    if (ch * pc.chunk >= n) return;   // past this query's chunks (uniform per workgroup)

    vec4 qr[D4];
    [[unroll]] for (uint c = 0; c < D4; ++c) qr[c] = vec4(q[qi * D4 + c]) * pc.scale_log2;
    const vec2 ct = qc[qi];

    vec4 acc[D4];
    [[unroll]] for (uint c = 0; c < D4; ++c) acc[c] = vec4(0.0);
    float m = NEG;
    float l = 0.0;

    const uint lo = ch * pc.chunk;
    const uint hi = min(lo + pc.chunk, n);
    for (uint b0 = lo; b0 < hi; b0 += pc.block) {
        // Block flags are indexed per query head's cache: entry0 / block is exact because
        // each head's entries start on a block boundary of the flag array (host layout).
        if (kept[(e0 + b0) / pc.block] == 0u) continue;
        const uint b1 = min(b0 + pc.block, hi);
        for (uint j = b0 + tid; j < b1; j += WG) {
            const uint e = e0 + j;
            if (epos[e] > int(qpos)) continue;
            float sc = 0.0;
            [[unroll]] for (uint c = 0; c < D4; ++c) sc += dot(qr[c], vec4(k[e * D4 + c]));
            const vec2 cj = ce[e];
            sc += ((ct.x - cj.x) + (ct.y - cj.y)) * LOG2E;
            if (sc > m) {
                const float a = exp2(m - sc);
                [[unroll]] for (uint c = 0; c < D4; ++c) acc[c] *= a;
                l *= a;
                m = sc;
            }
            const float p = exp2(sc - m);
            l += p;
            [[unroll]] for (uint c = 0; c < D4; ++c) acc[c] += p * vec4(v[e * D4 + c]);
        }
    }

#if USE_SUBGROUP
    // Max over the workgroup: subgroup max, then across subgroups through shared memory.
    const float msg = subgroupMax(m);
    if (subgroupElect()) sg_m[gl_SubgroupID] = msg;
    barrier();
    float mw = NEG;
    for (uint g = 0; g < gl_NumSubgroups; ++g) mw = max(mw, sg_m[g]);
    const float f = exp2(m - mw);
    const float lsg = subgroupAdd(l * f);
    if (subgroupElect()) sg_l[gl_SubgroupID] = lsg;
    [[unroll]] for (uint c = 0; c < D4; ++c) {
        const vec4 x = subgroupAdd(acc[c] * f);
        if (subgroupElect()) sg_o[gl_SubgroupID * D4 + c] = x;
    }
    barrier();
    if (tid == 0u) {
        float lw = 0.0;
        for (uint g = 0; g < gl_NumSubgroups; ++g) lw += sg_l[g];
        part_ml[out_idx] = vec2(mw, lw);
    }
    for (uint c = tid; c < D4; c += WG) {
        vec4 x = vec4(0.0);
        for (uint g = 0; g < gl_NumSubgroups; ++g) x += sg_o[g * D4 + c];
        part_o[out_idx * D4 + c] = x;
    }
#else
    // Shared-memory tree reductions (no subgroup operations).
    red_m[tid] = m;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1u) {
        if (tid < s) red_m[tid] = max(red_m[tid], red_m[tid + s]);
        barrier();
    }
    const float mw = red_m[0];
    const float f = exp2(m - mw);
    red_l[tid] = l * f;
    barrier();
    for (uint s = WG / 2u; s > 0u; s >>= 1u) {
        if (tid < s) red_l[tid] += red_l[tid + s];
        barrier();
    }
    if (tid == 0u) part_ml[out_idx] = vec2(mw, red_l[0]);
    for (uint c = 0; c < D4; ++c) {
        barrier();
        red_o[tid] = acc[c] * f;
        barrier();
        for (uint s = WG / 2u; s > 0u; s >>= 1u) {
            if (tid < s) red_o[tid] += red_o[tid + s];
            barrier();
        }
        if (tid == 0u) part_o[out_idx * D4 + c] = red_o[0];
    }
#endif
}
