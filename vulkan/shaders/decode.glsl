// Forgetting-attention decode, split over the cache (flash-decoding), pass 1 of 2.
//
// One workgroup per (query, chunk of CHUNK cache entries), online softmax over the chunk's
// kept blocks:
//   w_j = exp(s q.k_j + c_t - c_j),  m = max log2 w,  l = sum 2^(log2 w - m),  o = sum 2^(.) v_j
// then the workgroup merges its parts exactly (rescale to the common max) and writes one
// partial (m, l, o[D]) per chunk. decode_merge.comp merges the chunks.
// USE_SUBGROUP: a team of TPE consecutive lanes shares an entry (each lane D/TPE columns,
// one coalesced row read per team), the dot product is reduced with subgroupShuffleXor
// (needs subgroup size a multiple of TPE, checked by the host). Otherwise each thread owns
// whole entries and the workgroup reduces through shared memory.
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
#extension GL_KHR_shader_subgroup_shuffle : require
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WGS = 128;  // power of two
layout(constant_id = 1) const uint D = 64;
layout(constant_id = 2) const uint TPE = 8;     // lanes per entry (USE_SUBGROUP), divides D/4
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
const uint TEAMS = WGS / TPE;
const uint CL = D4 / TPE;        // vec4 columns per lane
shared vec4 tm_o[TEAMS * D4];    // [team][D4]
shared float tm_m[TEAMS];
shared float tm_l[TEAMS];
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
    const vec2 ct = qc[qi];
    const uint lo = ch * pc.chunk;
    const uint hi = min(lo + pc.chunk, n);
    float m = NEG;
    float l = 0.0;

#if USE_SUBGROUP
    const uint team = tid / TPE;
    const uint lane = tid % TPE;
    vec4 qr[CL];
    vec4 acc[CL];
    [[unroll]] for (uint c = 0; c < CL; ++c) {
        qr[c] = q[qi * D4 + lane + TPE * c] * pc.scale_log2;
        acc[c] = vec4(0.0);
    }
    for (uint b0 = lo; b0 < hi; b0 += pc.block) {
        if (kept[(e0 + b0) / pc.block] == 0u) continue;
        const uint b1 = min(b0 + pc.block, hi);
        // The loop bound is uniform per workgroup; teams past b1 idle but still shuffle.
        // Two entries per team and iteration keep two rows' loads in flight.
        for (uint jb = b0; jb < b1; jb += 2u * TEAMS) {
            float part[2];
            vec4 vr[2][CL];
            uint e[2];
            bool live[2];
            [[unroll]] for (uint x = 0; x < 2u; ++x) {
                const uint j = jb + team + x * TEAMS;
                live[x] = j < b1;
                e[x] = e0 + min(j, b1 - 1u);
                part[x] = 0.0;
            }
            [[unroll]] for (uint x = 0; x < 2u; ++x) {
                [[unroll]] for (uint c = 0; c < CL; ++c) {
                    part[x] += dot(qr[c], vec4(k[e[x] * D4 + lane + TPE * c]));
                    vr[x][c] = vec4(v[e[x] * D4 + lane + TPE * c]);
                }
            }
            [[unroll]] for (uint o2 = 1u; o2 < TPE; o2 <<= 1) {
                part[0] += subgroupShuffleXor(part[0], o2);
                part[1] += subgroupShuffleXor(part[1], o2);
            }
            [[unroll]] for (uint x = 0; x < 2u; ++x) {
                if (!live[x] || epos[e[x]] > int(qpos)) continue;
                const vec2 cj = ce[e[x]];
                const float sc = part[x] + ((ct.x - cj.x) + (ct.y - cj.y)) * LOG2E;
                if (sc > m) {
                    const float a = exp2(m - sc);
                    [[unroll]] for (uint c = 0; c < CL; ++c) acc[c] *= a;
                    l *= a;
                    m = sc;
                }
                const float p = exp2(sc - m);
                l += p;
                [[unroll]] for (uint c = 0; c < CL; ++c) acc[c] += p * vr[x][c];
            }
        }
    }
    // Merge the teams: common max, then sums through shared memory.
    if (lane == 0u) { tm_m[team] = m; tm_l[team] = l; }
    barrier();
    float mw = NEG;
    for (uint g = 0; g < TEAMS; ++g) mw = max(mw, tm_m[g]);
    const float f = exp2(m - mw);
    [[unroll]] for (uint c = 0; c < CL; ++c) tm_o[team * D4 + lane + TPE * c] = acc[c] * f;
    barrier();
    if (tid == 0u) {
        float lw = 0.0;
        for (uint g = 0; g < TEAMS; ++g) lw += tm_l[g] * exp2(tm_m[g] - mw);
        part_ml[out_idx] = vec2(mw, lw);
    }
    for (uint c = tid; c < D4; c += WG) {
        vec4 x = vec4(0.0);
        for (uint g = 0; g < TEAMS; ++g) x += tm_o[g * D4 + c];
        part_o[out_idx * D4 + c] = x;
    }
#else
    vec4 qr[D4];
    [[unroll]] for (uint c = 0; c < D4; ++c) qr[c] = vec4(q[qi * D4 + c]) * pc.scale_log2;
    vec4 acc[D4];
    [[unroll]] for (uint c = 0; c < D4; ++c) acc[c] = vec4(0.0);
    for (uint b0 = lo; b0 < hi; b0 += pc.block) {
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
