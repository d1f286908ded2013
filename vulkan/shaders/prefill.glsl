// Forgetting-attention prefill, one workgroup per (query block, query head slab).
//
//   o_i = sum_j w_ij v_j / sum_j w_ij,  w_ij = exp(s q_i.k_j + c_i - c_j),
//   j in [first_i, i],  first_i = max(seq_start, start_block * block_k) of the ACP query
//   block that row i lies in (causal, left padding, ACP start from foxedge-core).
//
// Work is in log2 units: q is pre-scaled by s*log2(e) and D by log2(e), so exp -> exp2.
// c arrives as a double-float pair (hi = f32(c), lo = f32(c - hi)); D = (hi_i - hi_j) +
// (lo_i - lo_j) keeps the error proportional to |D|, not to |c|, on any length.
//
// Tiles: BM query rows x BN keys. TPR threads share a query row: each scores BN/TPR keys
// of the tile and owns D/(4*TPR) vec4 columns of the output (interleaved, bank-friendly).
// Included by prefill_f32.comp / prefill_f16.comp, which set STORAGE_F16.
#extension GL_EXT_control_flow_attributes : enable
#if STORAGE_F16
#extension GL_EXT_shader_16bit_storage : require
#define SVEC4 f16vec4
#else
#define SVEC4 vec4
#endif

layout(local_size_x_id = 0) in;           // = BM * TPR
layout(constant_id = 1) const uint D = 64;   // head_dim, multiple of 4*TPR
layout(constant_id = 2) const uint BM = 64;  // query rows per tile
layout(constant_id = 3) const uint BN = 32;  // keys per tile, multiple of TPR
layout(constant_id = 4) const uint TPR = 4;    // threads per query row; D/4 and BN multiples of it
const uint WG = BM * TPR;
const uint D4 = D / 4;
const uint KS = D4 + 1;        // vec4 stride of a K/V row in shared memory (padded)
const uint OC = D4 / TPR;      // vec4 output columns per thread
const uint KPT = BN / TPR;     // keys per thread per tile
const float LOG2E = 1.4426950408889634;
const float NEG = -1.0e30;     // "minus infinity" that keeps exp2 and max free of NaN

layout(std430, set = 0, binding = 0) readonly buffer Qb { SVEC4 q[]; };   // [slab][seq_q][D]
layout(std430, set = 0, binding = 1) readonly buffer Kb { SVEC4 k[]; };   // [kv slab][seq_k][D]
layout(std430, set = 0, binding = 2) readonly buffer Vb { SVEC4 v[]; };   // [kv slab][seq_k][D]
layout(std430, set = 0, binding = 3) readonly buffer Cb { vec2 cg[]; };   // [slab][seq_k] (hi, lo)
layout(std430, set = 0, binding = 4) readonly buffer Sb { uint first_key[]; }; // [slab][acp_qb] (tokens)
layout(std430, set = 0, binding = 5) writeonly buffer Ob { vec4 o[]; };   // [slab][seq_q][D]
layout(std430, set = 0, binding = 6) writeonly buffer Lb { float lse[]; }; // [slab][seq_q], natural log
layout(std430, set = 0, binding = 7) buffer Fb { uint flag[]; };           // [1]: a softmax was not finite

layout(push_constant) uniform Push {
    uint seq_q;
    uint seq_k;
    uint q_off;      // seq_k - seq_q: key position of query row 0
    uint group;      // query heads per kv head
    uint n_qb;       // kernel query tiles (BM rows) per slab
    float scale_log2; // sm_scale * log2(e)
    uint acp_bq;     // rows per ACP query block (PrefillOptions::block_q)
    uint acp_nqb;    // ACP query blocks per slab
} pc;

shared vec4 ks[BN * KS];
shared vec4 vs[BN * KS];
shared vec2 cs[BN];
shared float ps[BM * (BN + 1)];
shared float red[WG];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint slab = gl_WorkGroupID.y;
    const uint kvs = slab / pc.group;
    // Longest rows first: the causal triangle makes late query blocks the heaviest.
    const uint qb = pc.n_qb - 1u - gl_WorkGroupID.x;
    const uint r = tid / TPR;
    const uint part = tid % TPR;
    const uint t = qb * BM + r;
    const bool row_ok = t < pc.seq_q;
    const uint i = pc.q_off + t;
    const uint first = first_key[slab * pc.acp_nqb + min(t, pc.seq_q - 1u) / pc.acp_bq];
    const bool row_live = row_ok && i >= first;

    vec4 qr[D4];
    [[unroll]] for (uint c = 0; c < D4; ++c) {
        qr[c] = row_ok ? vec4(q[(slab * pc.seq_q + t) * D4 + c]) * pc.scale_log2 : vec4(0.0);
    }
    const vec2 ci = row_ok ? cg[slab * pc.seq_k + i] : vec2(0.0);

    vec4 acc[OC];
    [[unroll]] for (uint c = 0; c < OC; ++c) acc[c] = vec4(0.0);
    float m = NEG;
    float l = 0.0;

    const uint last_t = min((qb + 1u) * BM, pc.seq_q) - 1u;
    const uint kb_end = (pc.q_off + last_t) / BN + 1u;
    // Starts never decrease down the rows (foxedge-core's two-pointer walk), so the
    // tile's first row has the smallest first key.
    const uint kb_begin = first_key[slab * pc.acp_nqb + (qb * BM) / pc.acp_bq] / BN;

    for (uint kb = kb_begin; kb < kb_end; ++kb) {
        const uint j0 = kb * BN;
        barrier();
        for (uint e = tid; e < BN * D4; e += WG) {
            const uint jj = e / D4;
            const uint c = e % D4;
            const uint j = j0 + jj;
            const bool ok = j < pc.seq_k;
            const uint src = (kvs * pc.seq_k + j) * D4 + c;
            ks[jj * KS + c] = ok ? vec4(k[src]) : vec4(0.0);
            vs[jj * KS + c] = ok ? vec4(v[src]) : vec4(0.0);
        }
        for (uint e = tid; e < BN; e += WG) {
            const uint j = j0 + e;
            cs[e] = j < pc.seq_k ? cg[slab * pc.seq_k + j] : vec2(0.0);
        }
        barrier();

        // Scores of this thread's keys: jj = part + TPR * u.
        float s[KPT];
        float mloc = NEG;
        [[unroll]] for (uint u = 0; u < KPT; ++u) {
            const uint jj = part + TPR * u;
            const uint j = j0 + jj;
            float dotv = 0.0;
            [[unroll]] for (uint c = 0; c < D4; ++c) dotv += dot(qr[c], ks[jj * KS + c]);
            const float dij = (ci.x - cs[jj].x) + (ci.y - cs[jj].y);
            const bool ok = row_live && j <= i && j >= first;
            s[u] = ok ? dotv + dij * LOG2E : NEG;
            mloc = max(mloc, s[u]);
        }
        red[tid] = mloc;
        barrier();
        float mblk = red[r * TPR];
        [[unroll]] for (uint p = 1; p < TPR; ++p) mblk = max(mblk, red[r * TPR + p]);
        const float mnew = max(m, mblk);
        const float alpha = exp2(m - mnew);
        float lsum = 0.0;
        [[unroll]] for (uint u = 0; u < KPT; ++u) {
            // Masked keys hold exactly NEG; a NaN score stays NaN (and flags the row).
            const float p = s[u] == NEG ? 0.0 : exp2(s[u] - mnew);
            ps[r * (BN + 1) + part + TPR * u] = p;
            lsum += p;
        }
        l = l * alpha + lsum;
        m = mnew;
        barrier();

        [[unroll]] for (uint c = 0; c < OC; ++c) acc[c] *= alpha;
        for (uint jj = 0; jj < BN; ++jj) {
            const float p = ps[r * (BN + 1) + jj];
            [[unroll]] for (uint c = 0; c < OC; ++c) acc[c] += p * vs[jj * KS + part + TPR * c];
        }
    }

    // Row normaliser: sum the TPR partial sums of the row.
    barrier();
    red[tid] = l;
    barrier();
    float lt = 0.0;
    [[unroll]] for (uint p = 0; p < TPR; ++p) lt += red[r * TPR + p];
    if (row_ok) {
        const float inv = lt > 0.0 ? 1.0 / lt : 0.0;
        [[unroll]] for (uint c = 0; c < OC; ++c) {
            o[(slab * pc.seq_q + t) * D4 + part + TPR * c] = acc[c] * inv;
        }
        if (part == 0u) {
            lse[slab * pc.seq_q + t] = lt > 0.0 ? (m + log2(lt)) / LOG2E : -1.0 / 0.0;
            // A row that attended keys needs a finite, positive normaliser and maximum.
            if (row_live && !(lt > 0.0 && lt <= 3.4e38 && abs(m) <= 3.4e38)) flag[0] = 1u;
        }
    }
}
