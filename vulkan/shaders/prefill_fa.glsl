// Forgetting-attention prefill on tensor cores with the softmax in registers
// (VK_NV_cooperative_matrix, f16 storage, head_dim 64). Same function and inputs as
// prefill.glsl:
//   o_i = sum_j w_ij v_j / sum_j w_ij,  w_ij = exp(s q_i.k_j + c_i - c_j),  j in [first_i, i].
//
// Work list: workgroup w takes item items[w] = (slab, query tile) (host order: most key
// tiles first), so only tiles with rows run and the heaviest start first.
// A workgroup holds NSG subgroups of 32 lanes; subgroup g owns query rows t0 .. t0+15.
// Per 64-key tile (one workgroup barrier):
//   the whole workgroup stages the NEXT tile's K, V (f16) and c into registers (16-byte
//   loads), computes on the CURRENT tile in shared memory, then writes the staged tile to
//   the other shared buffer (double buffering);
//   S (16 x 64) = Q K^T            16 MMAs 16x16x16, f32 accumulators, K from shared;
//   softmax on S's accumulator elements in registers: each lane knows the (row, key) of
//   every element it holds (layout below), masks, takes row maxima with two quad
//   shuffles, turns S into P = exp2(x - m), rescales O's accumulators by alpha per row;
//   O (16 x 64) += f16(P) V        16 MMAs into O's persistent accumulators, V from shared.
//
// Accumulator layout (measured on the device before this kernel is used, see
// prefill_cm_probe.comp and `prefill.rs`): a lane holds 8 elements of a 16 x 16 f32
// matrix from two rows (slots s = 0, 1), and the 4 lanes of an aligned quad hold the same
// two rows, so a row's maximum and sum take two quad shuffles. Which element is in which
// slot and column: LAYOUT 1: slot (e >> 1) & 1, column 2 (L & 3) + (e & 1) + 8 (e >> 2),
// rows (L >> 2) + 8 s (the mma.m16n8k16 C fragment, two n8 halves one after the other);
// LAYOUT 2: the same with slot e >> 2 and column 2 (L & 3) + (e & 1) + 8 ((e >> 1) & 1);
// LAYOUT 0: read per lane from the `lay` table (rows of slots 0/1, slot bits, columns).
//
// A row that attended keys and ends with a non-finite softmax (NaN/inf in q or k, or an
// f32 overflow of s q.k) sets flag[0] = 1; the host turns it into an error.
// Included by prefill_fa.comp (SHARED_BLOCKS 1: 16-byte stores into shared memory through
// an aliased block, VK_KHR_workgroup_memory_explicit_layout) and prefill_fa_nb.comp (0).
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : enable
#if SHARED_BLOCKS
#extension GL_EXT_shared_memory_block : require
#endif

layout(local_size_x_id = 0) in;               // NSG * 32
layout(constant_id = 1) const uint NSG = 4;   // subgroups (16 query rows each) per workgroup
layout(constant_id = 2) const uint LAYOUT = 1; // accumulator layout (above)
const uint WG = NSG * 32u;
const uint D = 64;
const uint BN = 64;
const uint KST = D + 8;                       // f16 row stride of K / V tiles in shared memory
const uint TILE_H = BN * KST;                 // f16 elements of one K or V tile
const uint TILE_W = TILE_H / 8u;              // the same in 16-byte words
const uint ROW_W = KST / 8u;                  // 16-byte words per shared row (9)
const uint LD = BN * D / 8u;                  // 16-byte words of one tile in global memory
const uint LPT = (LD + WG - 1u) / WG;         // of them per thread
const float LOG2E = 1.4426950408889634;
const float NEG_INF = -1.0 / 0.0;

layout(std430, set = 0, binding = 0) readonly buffer Qb { float16_t q[]; };   // [slab][seq_q][D]
layout(std430, set = 0, binding = 1) readonly buffer Kb { uvec4 k4[]; };      // [kv slab][seq_k][D]
layout(std430, set = 0, binding = 2) readonly buffer Vb { uvec4 v4[]; };
layout(std430, set = 0, binding = 3) readonly buffer Cb { vec2 cg[]; };       // [slab][seq_k] (hi, lo)
layout(std430, set = 0, binding = 4) readonly buffer Sb { uint first_key[]; }; // [slab][acp_qb]
layout(std430, set = 0, binding = 5) writeonly buffer Ob { float o[]; };      // [slab][seq_q][D]
layout(std430, set = 0, binding = 6) writeonly buffer Lb { float lse[]; };    // [slab][seq_q]
layout(std430, set = 0, binding = 7) buffer Fb { uint flag[]; };              // [1]
layout(std430, set = 0, binding = 8) readonly buffer Ib { uvec2 items[]; };   // (slab, query tile)
layout(std430, set = 0, binding = 9) readonly buffer Yb { uvec4 lay_tab[]; }; // [32 lanes], LAYOUT 0

layout(push_constant) uniform Push {
    uint seq_q;
    uint seq_k;
    uint q_off;
    uint group;
    uint n_items;
    float scale_log2;
    uint acp_bq;
    uint acp_nqb;
    uint gx;          // workgroups along x (item = x + gx * y)
} pc;

// Two buffers x (K, V) tiles of BN rows, then c of two tiles.
#if SHARED_BLOCKS
shared SmemH { float16_t kvh[4u * TILE_H]; vec2 csh[2u * BN]; };
shared SmemW { uvec4 kvw[4u * TILE_W]; };
#else
shared float16_t kvh[4u * TILE_H];
shared vec2 csh[2u * BN];
#endif

#define F16M fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>
#define F32M fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>

void store_word(uint word, uvec4 w) {
#if SHARED_BLOCKS
    kvw[word] = w;
#else
    const uint h = word * 8u;
    [[unroll]] for (uint c = 0; c < 4u; ++c) {
        const f16vec2 p = unpackFloat2x16(w[c]);
        kvh[h + 2u * c] = p.x;
        kvh[h + 2u * c + 1u] = p.y;
    }
#endif
}

uvec4 lay;   // this lane's row of lay_tab (LAYOUT 0)

// Slot (0/1) and column (0..15) of accumulator element e of this lane.
uint e_slot(uint e) {
    return LAYOUT == 1u ? (e >> 1) & 1u : LAYOUT == 2u ? e >> 2 : (lay.z >> e) & 1u;
}
uint e_col(uint e, uint q4) {
    return LAYOUT == 1u ? 2u * q4 + (e & 1u) + 8u * (e >> 2)
        : LAYOUT == 2u ? 2u * q4 + (e & 1u) + 8u * ((e >> 1) & 1u)
        : (lay.w >> (4u * e)) & 15u;
}

void main() {
    // A plain read of q, never taken (seq_q > 0): descriptor reflection (vulkano) does not
    // count cooperative-matrix loads as uses and would drop the binding.
    if (pc.seq_q == 0u) {
        o[0] = float(q[0]);
    }
    const uint item_id = gl_WorkGroupID.x + pc.gx * gl_WorkGroupID.y;
    if (item_id >= pc.n_items) return;                    // uniform per workgroup
    const uvec2 item = items[item_id];
    const uint slab = item.x;
    const uint kvs = slab / pc.group;
    const uint tid = gl_LocalInvocationID.x;
    const uint sg = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint q4 = lane & 3u;
    lay = LAYOUT == 0u ? lay_tab[lane] : uvec4(0u);
    const uint g = lane >> 2;

    // Key tiles of the workgroup: starts never decrease down the rows (foxedge-core's
    // two-pointer walk), so the first row's first key is the smallest.
    const uint row0 = item.y * (NSG * 16u);
    const uint wg_last = min(row0 + NSG * 16u, pc.seq_q) - 1u;
    const uint kb_begin = first_key[slab * pc.acp_nqb + row0 / pc.acp_bq] / BN;
    const uint kb_end = (pc.q_off + wg_last) / BN + 1u;

    // This subgroup's rows and their key ranges (slot s: row g + 8 s).
    const uint t0 = row0 + sg * 16u;
    const bool sg_rows = t0 < pc.seq_q;
    uint ti[2];
    uint ii[2];
    uint fi[2];
    bool live[2];
    vec2 ci[2];
    [[unroll]] for (uint s = 0; s < 2u; ++s) {
        ti[s] = t0 + (LAYOUT == 0u ? (s == 0u ? lay.x : lay.y) : g + 8u * s);
        const uint tc = min(ti[s], pc.seq_q - 1u);
        ii[s] = pc.q_off + tc;
        fi[s] = first_key[slab * pc.acp_nqb + tc / pc.acp_bq];
        live[s] = ti[s] < pc.seq_q && ii[s] >= fi[s];
        ci[s] = cg[slab * pc.seq_k + ii[s]];
    }
    const uint sg_last = min(t0 + 15u, pc.seq_q - 1u);
    const uint sg_begin = first_key[slab * pc.acp_nqb + min(t0, pc.seq_q - 1u) / pc.acp_bq] / BN;
    const uint sg_end = sg_rows ? (pc.q_off + sg_last) / BN + 1u : 0u;
    // Keys every row of the subgroup attends: [first of the last row, i of the first row].
    const uint full_lo = first_key[slab * pc.acp_nqb + sg_last / pc.acp_bq];
    const uint full_hi = pc.q_off + t0;
    const bool all_rows = sg_rows && t0 + 15u < pc.seq_q;

    F16M qf[4];
    if (sg_rows) {
        const uint qoff = (slab * pc.seq_q + t0) * D;
        [[unroll]] for (uint c = 0; c < 4u; ++c) coopMatLoadNV(qf[c], q, qoff + 16u * c, D, false);
    }
    F32M acc[4];
    [[unroll]] for (uint n = 0; n < 4u; ++n) acc[n] = F32M(0.0);
    float m[2] = float[2](NEG_INF, NEG_INF);
    float l[2] = float[2](0.0, 0.0);

    // Staging: thread tid moves 16-byte words e = tid + WG u of the K and V tiles.
    uvec4 kst[LPT];
    uvec4 vst[LPT];
    vec2 cst = vec2(0.0);
    const uint kv_base = kvs * pc.seq_k;
    #define STAGE_LOAD(KB)                                                          \
    {                                                                               \
        const uint j0_ = (KB) * BN;                                                 \
        [[unroll]] for (uint u = 0; u < LPT; ++u) {                                 \
            const uint e = tid + WG * u;                                            \
            const uint j = j0_ + e / (D / 8u);                                      \
            const bool ok = e < LD && j < pc.seq_k;                                 \
            const uint src = (kv_base + j) * (D / 8u) + e % (D / 8u);               \
            kst[u] = ok ? k4[src] : uvec4(0u);                                      \
            vst[u] = ok ? v4[src] : uvec4(0u);                                      \
        }                                                                           \
        if (tid < BN) {                                                             \
            const uint j = j0_ + tid;                                               \
            cst = j < pc.seq_k ? cg[slab * pc.seq_k + j] : vec2(0.0);               \
        }                                                                           \
    }
    #define STAGE_STORE(BUF)                                                        \
    {                                                                               \
        [[unroll]] for (uint u = 0; u < LPT; ++u) {                                 \
            const uint e = tid + WG * u;                                            \
            if (e < LD) {                                                           \
                const uint w = (e / (D / 8u)) * ROW_W + e % (D / 8u);               \
                store_word((2u * (BUF)) * TILE_W + w, kst[u]);                      \
                store_word((2u * (BUF) + 1u) * TILE_W + w, vst[u]);                 \
            }                                                                       \
        }                                                                           \
        if (tid < BN) csh[(BUF) * BN + tid] = cst;                                  \
    }

    if (kb_begin < kb_end) {
        STAGE_LOAD(kb_begin);
        STAGE_STORE(0u);
    }
    barrier();

    uint buf = 0u;
    for (uint kb = kb_begin; kb < kb_end; ++kb) {
        const bool more = kb + 1u < kb_end;
        if (more) STAGE_LOAD(kb + 1u);

        if (kb >= sg_begin && kb < sg_end) {                 // uniform per subgroup
            const uint j0 = kb * BN;
            const uint kt = (2u * buf) * TILE_H;
            const uint vt = kt + TILE_H;
            // S = Q K^T: four 16-key column blocks.
            F32M sm[4];
            [[unroll]] for (uint n = 0; n < 4u; ++n) {
                sm[n] = F32M(0.0);
                [[unroll]] for (uint c = 0; c < 4u; ++c) {
                    F16M kf;
                    coopMatLoadNV(kf, kvh, kt + n * 16u * KST + c * 16u, KST, true);
                    sm[n] = coopMatMulAddNV(qf[c], kf, sm[n]);
                }
            }
            // Scores in log2 units, masked to -inf outside [first_i, i] and past seq_k.
            const bool full = all_rows && j0 >= full_lo && j0 + BN - 1u <= full_hi
                && j0 + BN <= pc.seq_k && live[0] && live[1];
            float mloc[2] = float[2](NEG_INF, NEG_INF);
            [[unroll]] for (uint n = 0; n < 4u; ++n) {
                [[unroll]] for (uint e = 0; e < 8u; ++e) {
                    const bool s1 = e_slot(e) == 1u;
                    const uint jj = n * 16u + e_col(e, q4);
                    const vec2 cj = csh[buf * BN + jj];
                    const vec2 cr = s1 ? ci[1] : ci[0];
                    float x = sm[n][e] * pc.scale_log2 + ((cr.x - cj.x) + (cr.y - cj.y)) * LOG2E;
                    if (!full) {
                        const uint j = j0 + jj;
                        const bool ok = (s1 ? live[1] : live[0]) && j <= (s1 ? ii[1] : ii[0])
                            && j >= (s1 ? fi[1] : fi[0]) && j < pc.seq_k;
                        x = ok ? x : NEG_INF;
                    }
                    sm[n][e] = x;
                    mloc[0] = max(mloc[0], s1 ? NEG_INF : x);
                    mloc[1] = max(mloc[1], s1 ? x : NEG_INF);
                }
            }
            float alpha[2];
            float msafe[2];
            [[unroll]] for (uint s = 0; s < 2u; ++s) {
                mloc[s] = max(mloc[s], subgroupShuffleXor(mloc[s], 1u));
                mloc[s] = max(mloc[s], subgroupShuffleXor(mloc[s], 2u));
                const float mnew = max(m[s], mloc[s]);
                msafe[s] = mnew == NEG_INF ? 0.0 : mnew;
                alpha[s] = exp2(m[s] - msafe[s]);
                m[s] = mnew;
                l[s] *= alpha[s];
            }
            F16M pf[4];
            [[unroll]] for (uint n = 0; n < 4u; ++n) {
                [[unroll]] for (uint e = 0; e < 8u; ++e) {
                    const bool s1 = e_slot(e) == 1u;
                    const float p = exp2(sm[n][e] - (s1 ? msafe[1] : msafe[0]));
                    sm[n][e] = p;
                    l[0] += s1 ? 0.0 : p;
                    l[1] += s1 ? p : 0.0;
                    acc[n][e] *= s1 ? alpha[1] : alpha[0];
                }
                pf[n] = F16M(sm[n]);
            }
            // O += P V: P's 16-key block c against V rows c*16.., output columns n*16...
            [[unroll]] for (uint n = 0; n < 4u; ++n) {
                [[unroll]] for (uint c = 0; c < 4u; ++c) {
                    F16M vf;
                    coopMatLoadNV(vf, kvh, vt + c * 16u * KST + n * 16u, KST, false);
                    acc[n] = coopMatMulAddNV(pf[c], vf, acc[n]);
                }
            }
        }

        if (more) STAGE_STORE(buf ^ 1u);
        barrier();
        buf ^= 1u;
    }

    if (!sg_rows) return;
    float inv[2];
    [[unroll]] for (uint s = 0; s < 2u; ++s) {
        float lt = l[s];
        lt += subgroupShuffleXor(lt, 1u);
        lt += subgroupShuffleXor(lt, 2u);
        inv[s] = lt > 0.0 ? 1.0 / lt : 0.0;
        if (live[s] && !(lt > 0.0 && lt <= 3.4e38 && abs(m[s]) <= 3.4e38)) flag[0] = 1u;
        if (q4 == 0u && ti[s] < pc.seq_q) {
            lse[slab * pc.seq_q + ti[s]] = lt > 0.0 ? (m[s] + log2(lt)) / LOG2E : NEG_INF;
        }
    }
    [[unroll]] for (uint n = 0; n < 4u; ++n) {
        [[unroll]] for (uint e = 0; e < 8u; ++e) {
            const bool s1 = e_slot(e) == 1u;
            const uint t = s1 ? ti[1] : ti[0];
            if (t < pc.seq_q) {
                const uint col = n * 16u + e_col(e, q4);
                o[(slab * pc.seq_q + t) * D + col] = acc[n][e] * (s1 ? inv[1] : inv[0]);
            }
        }
    }
}
