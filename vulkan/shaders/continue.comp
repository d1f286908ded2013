#version 450
// Continuation prefill: a chunk of n queries attends its head's resident cache rows (an
// unordered set, each row with its own c_j) and, causally, the chunk's own keys, in one
// online softmax, so the two parts merge exactly (one running max and sum):
//
//   o_i = sum_j w_ij v_j / sum_j w_ij,  w_ij = exp(s q_i.k_j + c_i - c_j),
//   j over cache rows 0..live with i < cache_end_j, then chunk keys j <= i with i < key_end_j.
//
// One workgroup per (query tile of BM rows, head slot of the dispatch). Key tiles of BN:
// first the cache rows in slot order (decode.glsl's head layout: [cap rows of K][cap rows of
// V][cap meta uvec4 (c_hi, c_lo, pos_lo, pos_hi)], f32 rows), then the chunk's keys up to the
// diagonal ([H][n][D], head-major). ACP: the host's flag per (64-query block, 64-key block),
// cache blocks then chunk blocks (foxedge-core's continue_tile_pruned, as the CPU kernel
// decides); a pruned block's keys are skipped by every query of the tile. Ends: where the
// retention policy evicted a key while the chunk was appended, the first query that no
// longer sees it (the CPU continuation's cache_end / key_end).
//
// Units and tile arithmetic are prefill.glsl's: log2 units (q pre-scaled by s*log2(e), D by
// log2(e)), c as double-float pairs, TPR threads per query row.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;              // = BM * TPR
layout(constant_id = 1) const uint D = 64;   // head_dim, multiple of 4*TPR
layout(constant_id = 2) const uint BM = 64;  // query rows per tile, divides 64
layout(constant_id = 3) const uint BN = 32;  // keys per tile, divides 64, multiple of TPR
layout(constant_id = 4) const uint TPR = 4;  // threads per query row
#define HPD 8                                // head buffers per dispatch
const uint WG = BM * TPR;
const uint D4 = D / 4;
const uint KS = D4 + 1;        // vec4 stride of a K/V row in shared memory (padded)
const uint OC = D4 / TPR;      // vec4 output columns per thread
const uint KPT = BN / TPR;     // keys per thread per tile
const uint ACPB = 64;          // queries and keys per ACP block
const uint NONE = 0xffffffffu;
const float LOG2E = 1.4426950408889634;
const float NEG = -1.0e30;

layout(std430, set = 0, binding = 0) readonly buffer Qb { vec4 q[]; };    // [H][n][D]
layout(std430, set = 0, binding = 1) readonly buffer Kb { vec4 k[]; };    // [H][n][D]
layout(std430, set = 0, binding = 2) readonly buffer Vb { vec4 v[]; };    // [H][n][D]
layout(std430, set = 0, binding = 3) readonly buffer Hb { uvec4 x[]; } hb[HPD];
layout(std430, set = 0, binding = 4) readonly buffer Cb { vec2 cg[]; };   // [H][n] (hi, lo)
layout(std430, set = 0, binding = 5) readonly buffer Ib { uvec4 info[]; }; // [slot] (live, cap, kept_off, ends_off)
layout(std430, set = 0, binding = 6) readonly buffer Wb { uint words[]; }; // kept flags and ends
layout(std430, set = 0, binding = 7) writeonly buffer Ob { vec4 o[]; };   // [H][n][D]
layout(std430, set = 0, binding = 8) buffer Fb { uint flag[]; };          // [1]: not finite

layout(push_constant) uniform Push {
    uint n;           // queries (and chunk keys) per head
    uint h0;          // head of slot 0
    uint n_qt;        // query tiles per head
    float scale_log2; // sm_scale * log2(e)
} pc;

shared vec4 ks[BN * KS];
shared vec4 vs[BN * KS];
shared vec2 cs[BN];
shared uint es[BN];
shared float ps[BM * (BN + 1)];
shared float red[WG];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint slot = gl_WorkGroupID.y;
    const uint h = pc.h0 + slot;
    const uint qt = pc.n_qt - 1u - gl_WorkGroupID.x;
    const uint r = tid / TPR;
    const uint part = tid % TPR;
    const uint t = qt * BM + r;
    const bool row_ok = t < pc.n;
    const uvec4 inf = info[slot];
    const uint live = inf.x;
    const uint cap = inf.y;
    const uint kept_off = inf.z;
    const uint ends_off = inf.w;
    const uint ncb = (live + ACPB - 1u) / ACPB;
    const uint stride = ncb + (pc.n + ACPB - 1u) / ACPB;
    const uint krow = kept_off + ((qt * BM) / ACPB) * stride;

    vec4 qr[D4];
    [[unroll]] for (uint c = 0; c < D4; ++c) {
        qr[c] = row_ok ? q[(h * pc.n + t) * D4 + c] * pc.scale_log2 : vec4(0.0);
    }
    const vec2 ci = row_ok ? cg[h * pc.n + t] : vec2(0.0);

    vec4 acc[OC];
    [[unroll]] for (uint c = 0; c < OC; ++c) acc[c] = vec4(0.0);
    float m = NEG;
    float l = 0.0;

    const uint last_t = min((qt + 1u) * BM, pc.n) - 1u;
    const uint n_cache_tiles = (live + BN - 1u) / BN;
    const uint n_tiles = n_cache_tiles + last_t / BN + 1u;
    for (uint kb = 0; kb < n_tiles; ++kb) {
        const bool cache = kb < n_cache_tiles;
        const uint j0 = (cache ? kb : kb - n_cache_tiles) * BN;
        const uint blk = cache ? j0 / ACPB : ncb + j0 / ACPB;
        if (kept_off != NONE && words[krow + blk] == 0u) continue;
        barrier();
        if (cache) {
            for (uint e = tid; e < BN * D4; e += WG) {
                const uint jj = e / D4;
                const uint c = e % D4;
                const uint j = j0 + jj;
                const bool ok = j < live;
                ks[jj * KS + c] = ok ? uintBitsToFloat(hb[slot].x[j * D4 + c]) : vec4(0.0);
                vs[jj * KS + c] = ok ? uintBitsToFloat(hb[slot].x[(cap + j) * D4 + c]) : vec4(0.0);
            }
            for (uint e = tid; e < BN; e += WG) {
                const uint j = j0 + e;
                const bool ok = j < live;
                cs[e] = ok ? uintBitsToFloat(hb[slot].x[2u * cap * D4 + j].xy) : vec2(0.0);
                es[e] = !ok ? 0u : ends_off == NONE ? pc.n : words[ends_off + j];
            }
        } else {
            for (uint e = tid; e < BN * D4; e += WG) {
                const uint jj = e / D4;
                const uint c = e % D4;
                const uint j = j0 + jj;
                const bool ok = j < pc.n;
                const uint src = (h * pc.n + j) * D4 + c;
                ks[jj * KS + c] = ok ? k[src] : vec4(0.0);
                vs[jj * KS + c] = ok ? v[src] : vec4(0.0);
            }
            for (uint e = tid; e < BN; e += WG) {
                const uint j = j0 + e;
                const bool ok = j < pc.n;
                cs[e] = ok ? cg[h * pc.n + j] : vec2(0.0);
                es[e] = !ok ? 0u : ends_off == NONE ? pc.n : words[ends_off + live + j];
            }
        }
        barrier();

        float s[KPT];
        float mloc = NEG;
        [[unroll]] for (uint u = 0; u < KPT; ++u) {
            const uint jj = part + TPR * u;
            const uint j = j0 + jj;
            float dotv = 0.0;
            [[unroll]] for (uint c = 0; c < D4; ++c) dotv += dot(qr[c], ks[jj * KS + c]);
            const float dij = (ci.x - cs[jj].x) + (ci.y - cs[jj].y);
            const bool ok = row_ok && t < es[jj] && (cache || j <= t);
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

    barrier();
    red[tid] = l;
    barrier();
    float lt = 0.0;
    [[unroll]] for (uint p = 0; p < TPR; ++p) lt += red[r * TPR + p];
    if (row_ok) {
        const float inv = lt > 0.0 ? 1.0 / lt : 0.0;
        [[unroll]] for (uint c = 0; c < OC; ++c) {
            o[(h * pc.n + t) * D4 + part + TPR * c] = acc[c] * inv;
        }
        // Every query sees its own key: a finite, positive normaliser and maximum.
        if (part == 0u && !(lt > 0.0 && lt <= 3.4e38 && abs(m) <= 3.4e38)) flag[0] = 1u;
    }
}
