// Forgetting-attention decode in one dispatch: split over the cache (flash-decoding) and an
// exact merge done by the last workgroup of each query to finish.
//
// One workgroup per (query, chunk of pc.chunk cache entries); online softmax over the
// chunk's kept blocks, in log2 units:
//   s_j = log2(e) (s q.k_j + c_t - c_j),  m = max_j s_j,  l = sum 2^(s_j - m),
//   o = sum 2^(s_j - m) v_j
// Each workgroup writes its partial (m, l, o[D]); the workgroup that raises the query's
// counter to its chunk count merges them exactly (rescale to the common max) into o / l and
// lse = (M + log2 L) / log2(e), and resets the counter for the next dispatch. A query with a
// single chunk writes its result directly. A row that attended entries but ended with a
// non-finite (m, l) (NaN/inf in q, k, v, or an f32 overflow of s q.k) sets flag[0] = 1,
// which the host reports as an error.
//
// Cache heads are separate buffers (hb[slot], up to HPD per dispatch), each laid out as
//   [cap rows of K][cap rows of V][cap meta uvec4 = (c_hi, c_lo, pos_lo, pos_hi)]
// with a row of D elements packed in uvec4 words: 8 f16 (STORAGE_F16) or 4 f32 each.
// c is a double-float pair (f32 bits of hi, lo); positions are u64 (lo, hi) and mask
// entries newer than the query when the query carries a position.
// USE_SUBGROUP: a team of TPE consecutive lanes shares an entry (each lane CL uvec4 of the
// row, one coalesced 16-byte load per lane), the dot product reduced with subgroupShuffleXor
// (subgroup size a multiple of TPE, checked by the host); otherwise TPE = 1.
#extension GL_EXT_control_flow_attributes : enable
#if USE_SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WGS = 128;  // threads, a power of two
layout(constant_id = 1) const uint D = 64;     // head dim, multiple of 8
layout(constant_id = 2) const uint TPE = 8;    // lanes per entry, divides RV
layout(constant_id = 3) const uint UNR = 2;    // entries per team per iteration
layout(constant_id = 4) const uint HPD = 8;    // head buffers per dispatch
#define MAXC 1024                               // chunks per query at most
#if STORAGE_F16
const uint EPW = 8;  // elements per uvec4
const uint VPW = 2;  // vec4 per uvec4
#else
const uint EPW = 4;
const uint VPW = 1;
#endif
const uint D4 = D / 4;
const uint RV = D / EPW;        // uvec4 per row
const uint CL = RV / TPE;       // uvec4 per lane
const uint QV = CL * VPW;       // vec4 per lane
const uint TEAMS = WGS / TPE;
const float LOG2E = 1.4426950408889634;
const float NEG = -1.0e30;      // running-max start: finite, so 2^(NEG - NEG) stays defined

layout(std430, set = 0, binding = 0) readonly buffer Qb { vec4 q[]; };          // [query][D]
layout(std430, set = 0, binding = 1) readonly buffer Hb { uvec4 x[]; } hb[HPD]; // per head slot
layout(std430, set = 0, binding = 2) readonly buffer Ib { uvec4 qinfo[]; };     // [query][2]
layout(std430, set = 0, binding = 3) readonly buffer Qc { vec2 qc[]; };         // [query] (hi, lo)
layout(std430, set = 0, binding = 4) readonly buffer Kp { uint kept[]; };       // block flags
layout(std430, set = 0, binding = 5) coherent buffer Pm { vec2 part_ml[]; };    // [part] (m, l)
layout(std430, set = 0, binding = 6) coherent buffer Po { vec4 part_o[]; };     // [part][D]
layout(std430, set = 0, binding = 7) writeonly buffer Ob { vec4 o[]; };         // [query][D]
layout(std430, set = 0, binding = 8) writeonly buffer Lb { float lse[]; };      // [query]
layout(std430, set = 0, binding = 9) coherent buffer Cn { uint counter[]; };    // [query], 0 between dispatches
layout(std430, set = 0, binding = 10) buffer Fl { uint flag[]; };               // [1]

layout(push_constant) uniform Push {
    uint chunk;        // entries per chunk, multiple of block
    uint block;        // entries per ACP block
    float scale_log2;  // sm_scale * log2(e)
    uint pad;
} pc;

shared vec4 tm_o[TEAMS * D4];   // [team][D4], reused as [group][D4] by the merge
shared float tm_m[TEAMS];
shared float tm_l[TEAMS];
shared float red[WGS];
shared float s_w[MAXC];
shared bool s_last;

float ninf() { return uintBitsToFloat(0xff800000u); }
bool finite(float x) { return (floatBitsToUint(x) & 0x7f800000u) != 0x7f800000u; }

// Unpacks uvec4 word w into vec4 number t (< VPW) of the elements it holds.
vec4 unpack4(uvec4 w, uint t) {
#if STORAGE_F16
    return t == 0u ? vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y))
                   : vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
#else
    return uintBitsToFloat(w);
#endif
}

float wg_max(float v) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();
    red[tid] = v;
    barrier();
    for (uint s = WGS / 2u; s > 0u; s >>= 1u) {
        if (tid < s) red[tid] = max(red[tid], red[tid + s]);
        barrier();
    }
    return red[0];
}

float wg_sum(float v) {
    const uint tid = gl_LocalInvocationID.x;
    barrier();
    red[tid] = v;
    barrier();
    for (uint s = WGS / 2u; s > 0u; s >>= 1u) {
        if (tid < s) red[tid] += red[tid + s];
        barrier();
    }
    return red[0];
}

// Writes the final row of query qi from (M, L) and the column sums x (one vec4 column).
void finish_col(uint qi, uint col, vec4 x, float L) {
    o[qi * D4 + col] = L > 0.0 ? x / L : vec4(0.0);
}

void finish_row(uint qi, float M, float L) {
    const bool none = L == 0.0 && M == NEG;  // attended no entry: o = 0, lse = -inf
    if (!none && !(L > 0.0 && finite(L) && finite(M))) flag[0] = 1u;
    lse[qi] = L > 0.0 ? (M + log2(L)) / LOG2E : ninf();
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint qi = gl_WorkGroupID.y;
    const uint ch = gl_WorkGroupID.x;
    const uvec4 ia = qinfo[2u * qi];
    const uvec4 ib = qinfo[2u * qi + 1u];
    const uint n = ia.x, cap = ia.y, part0 = ia.z, kept0 = ia.w;
    const uint slot = ib.x;
    const bool use_pos = ib.y != 0u;
    const uvec2 qp = ib.zw;
    const uint nch = (n + pc.chunk - 1u) / pc.chunk;
    if (n == 0u) {  // empty head: zeros, lse = -inf
        if (ch == 0u) {
            for (uint c = tid; c < D4; c += WGS) o[qi * D4 + c] = vec4(0.0);
            if (tid == 0u) lse[qi] = ninf();
        }
        return;
    }
    if (ch >= nch) return;  // past this query's chunks (uniform per workgroup)
    const vec2 ct = qc[qi];
    const uint lo = ch * pc.chunk;
    const uint hi = min(lo + pc.chunk, n);
    const uint voff = cap * RV;
    const uint moff = 2u * cap * RV;
    const uint team = tid / TPE;
    const uint lane = tid % TPE;

    vec4 qr[QV];
    vec4 acc[QV];
    [[unroll]] for (uint c = 0; c < CL; ++c) {
        [[unroll]] for (uint t = 0; t < VPW; ++t) {
            qr[c * VPW + t] = q[qi * D4 + (lane + TPE * c) * VPW + t] * pc.scale_log2;
            acc[c * VPW + t] = vec4(0.0);
        }
    }
    float m = NEG;
    float l = 0.0;
    for (uint b0 = lo; b0 < hi; b0 += pc.block) {
        if (kept0 != 0xffffffffu && kept[kept0 + b0 / pc.block] == 0u) continue;
        const uint b1 = min(b0 + pc.block, hi);
        // Uniform loop bound; teams past b1 load a clamped row and drop it.
        for (uint jb = b0; jb < b1; jb += UNR * TEAMS) {
            float sc[UNR];
            uvec4 vw[UNR][CL];
            uvec4 meta[UNR];
            bool live[UNR];
            [[unroll]] for (uint x = 0; x < UNR; ++x) {
                const uint j = jb + team + x * TEAMS;
                live[x] = j < b1;
                const uint e = min(j, b1 - 1u);
                meta[x] = hb[slot].x[moff + e];
                float part = 0.0;
                [[unroll]] for (uint c = 0; c < CL; ++c) {
                    const uint w = e * RV + lane + TPE * c;
                    const uvec4 kw = hb[slot].x[w];
                    vw[x][c] = hb[slot].x[voff + w];
                    [[unroll]] for (uint t = 0; t < VPW; ++t) part += dot(qr[c * VPW + t], unpack4(kw, t));
                }
                sc[x] = part;
            }
#if USE_SUBGROUP
            [[unroll]] for (uint o2 = 1u; o2 < TPE; o2 <<= 1) {
                [[unroll]] for (uint x = 0; x < UNR; ++x) sc[x] += subgroupShuffleXor(sc[x], o2);
            }
#endif
            float mx = m;
            [[unroll]] for (uint x = 0; x < UNR; ++x) {
                const uvec4 mt = meta[x];
                const bool newer = use_pos && (mt.w > qp.y || (mt.w == qp.y && mt.z > qp.x));
                const vec2 cj = uintBitsToFloat(mt.xy);
                sc[x] = (live[x] && !newer) ? sc[x] + ((ct.x - cj.x) + (ct.y - cj.y)) * LOG2E : ninf();
                mx = max(mx, sc[x]);
            }
            if (mx > m) {
                const float a = exp2(m - mx);
                [[unroll]] for (uint c = 0; c < QV; ++c) acc[c] *= a;
                l *= a;
                m = mx;
            }
            [[unroll]] for (uint x = 0; x < UNR; ++x) {
                const float p = exp2(sc[x] - m);
                l += p;
                [[unroll]] for (uint c = 0; c < CL; ++c) {
                    [[unroll]] for (uint t = 0; t < VPW; ++t) acc[c * VPW + t] += p * unpack4(vw[x][c], t);
                }
            }
        }
    }

    // Merge the teams of this workgroup: common max, sums through shared memory.
    if (lane == 0u) { tm_m[team] = m; tm_l[team] = l; }
    barrier();
    float mw = NEG;
    for (uint g = 0; g < TEAMS; ++g) mw = max(mw, tm_m[g]);
    const float f = exp2(m - mw);
    [[unroll]] for (uint c = 0; c < CL; ++c) {
        [[unroll]] for (uint t = 0; t < VPW; ++t) {
            tm_o[team * D4 + (lane + TPE * c) * VPW + t] = acc[c * VPW + t] * f;
        }
    }
    barrier();
    float lw = 0.0;
    for (uint g = 0; g < TEAMS; ++g) lw += tm_l[g] * exp2(tm_m[g] - mw);
    if (nch == 1u) {
        for (uint c = tid; c < D4; c += WGS) {
            vec4 s = vec4(0.0);
            for (uint g = 0; g < TEAMS; ++g) s += tm_o[g * D4 + c];
            finish_col(qi, c, s, lw);
        }
        if (tid == 0u) finish_row(qi, mw, lw);
        return;
    }
    const uint pi = part0 + ch;
    if (tid == 0u) part_ml[pi] = vec2(mw, lw);
    for (uint c = tid; c < D4; c += WGS) {
        vec4 s = vec4(0.0);
        for (uint g = 0; g < TEAMS; ++g) s += tm_o[g * D4 + c];
        part_o[pi * D4 + c] = s;
    }
    // Publish the partial, then count; the last workgroup of this query merges.
    memoryBarrierBuffer();
    barrier();
    if (tid == 0u) s_last = atomicAdd(counter[qi], 1u) == nch - 1u;
    barrier();
    if (!s_last) return;
    memoryBarrierBuffer();

    float mc = NEG;
    for (uint c = tid; c < nch; c += WGS) mc = max(mc, part_ml[part0 + c].x);
    const float M = wg_max(mc);
    float lc = 0.0;
    for (uint c = tid; c < nch; c += WGS) {
        const vec2 ml = part_ml[part0 + c];
        const float w = exp2(ml.x - M);
        s_w[c] = w;
        lc += ml.y * w;
    }
    const float L = wg_sum(lc);  // its barriers also publish s_w
    const uint G = max(1u, WGS / D4);
    for (uint i = tid; i < G * D4; i += WGS) {
        const uint g = i / D4, c = i % D4;
        vec4 s = vec4(0.0);
        for (uint k = g; k < nch; k += G) s += part_o[(part0 + k) * D4 + c] * s_w[k];
        tm_o[g * D4 + c] = s;
    }
    barrier();
    for (uint c = tid; c < D4; c += WGS) {
        vec4 s = vec4(0.0);
        for (uint g = 0; g < G; ++g) s += tm_o[g * D4 + c];
        finish_col(qi, c, s, L);
    }
    if (tid == 0u) {
        finish_row(qi, M, L);
        counter[qi] = 0u;
    }
}
