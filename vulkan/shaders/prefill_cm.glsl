// Forgetting-attention prefill on tensor cores, f16 storage, head_dim 64: cooperative matrices
// of VK_KHR_cooperative_matrix (KHR defined: prefill_cm_khr.comp) or VK_NV_cooperative_matrix
// (prefill_cm.comp). Same function and inputs as prefill.glsl:
//   o_i = sum_j w_ij v_j / sum_j w_ij,  w_ij = exp(s q_i.k_j + c_i - c_j),  j in [first_i, i].
//
// A workgroup holds NSG subgroups; subgroup g owns 16 query rows and walks its own key
// tiles (64 keys) independently, so the tile loop needs no workgroup barrier:
//   S (16 x 64)  = Q (16 x 64) K^T          4 x 4 16x16x16 MMAs, K loaded column-major
//   scalar pass:  s = S * s log2e + D log2e, mask, online softmax (row max over the LPR
//                 lanes of a row with shuffles), P -> shared f16, rescale O by alpha
//   PV (16 x 64) = P (16 x 64) V             4 x 4 MMAs into a fresh accumulator,
//                 stored to shared and added to O (each lane owns one row's 64/LPR columns).
// The host pads k/v/q buffers by one tile so fragment loads past seq never leave them.
#ifdef KHR
#extension GL_KHR_cooperative_matrix : require
#else
#extension GL_NV_cooperative_matrix : require
#endif
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;               // NSG * SG
layout(constant_id = 2) const uint SG = 32;   // subgroup size, a multiple of 16
const uint D = 64;
const uint BN = 64;
const uint LPR = SG / 16;                     // lanes per query row
const uint KPL = BN / LPR;                    // keys per lane per tile
const uint CPL = D / LPR;                     // output columns per lane
const uint NSG = 4;
const uint SST = BN + 4;                      // f32 row stride of S / PV in shared memory
const uint PST = BN + 8;                      // f16 row stride of P in shared memory
const float LOG2E = 1.4426950408889634;
const float NEG = -1.0e30;

layout(std430, set = 0, binding = 0) readonly buffer Qb { float16_t q[]; };
layout(std430, set = 0, binding = 1) readonly buffer Kb { float16_t k[]; };
layout(std430, set = 0, binding = 2) readonly buffer Vb { float16_t v[]; };
layout(std430, set = 0, binding = 3) readonly buffer Cb { vec2 cg[]; };
layout(std430, set = 0, binding = 4) readonly buffer Sb { uint first_key[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Ob { float o[]; };
layout(std430, set = 0, binding = 6) writeonly buffer Lb { float lse[]; };
layout(std430, set = 0, binding = 7) buffer Fb { uint flag[]; };   // [1]: a softmax was not finite

layout(push_constant) uniform Push {
    uint seq_q;
    uint seq_k;
    uint q_off;
    uint group;
    uint n_qb;
    float scale_log2;
    uint acp_bq;
    uint acp_nqb;
} pc;

shared float ssh[NSG * 16 * SST];
shared float16_t psh[NSG * 16 * PST];

// 16 x 16 fragments: f16 A (left) and B (right) operands, f32 accumulators; loads and
// stores row-major (R) or column-major (C), offsets and strides in elements. (One fragment
// per declaration: glslang 13.1 gives the second of `coopmat<...> a, b;` no matrix use.)
#ifdef KHR
#define F16A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define F16B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define F32M coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define LOAD_R(m, b, o, s) coopMatLoad(m, b, o, s, gl_CooperativeMatrixLayoutRowMajor)
#define LOAD_C(m, b, o, s) coopMatLoad(m, b, o, s, gl_CooperativeMatrixLayoutColumnMajor)
#define STORE_R(m, b, o, s) coopMatStore(m, b, o, s, gl_CooperativeMatrixLayoutRowMajor)
#define MMA(a, b, c) coopMatMulAdd(a, b, c)
#else
#define F16A fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>
#define F16B F16A
#define F32M fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>
#define LOAD_R(m, b, o, s) coopMatLoadNV(m, b, o, s, false)
#define LOAD_C(m, b, o, s) coopMatLoadNV(m, b, o, s, true)
#define STORE_R(m, b, o, s) coopMatStoreNV(m, b, o, s, false)
#define MMA(a, b, c) coopMatMulAddNV(a, b, c)
#endif

void main() {
    // A plain read of q, k and v, never taken (seq_q > 0): descriptor reflection (vulkano)
    // does not count cooperative-matrix loads as uses, and would drop these bindings.
    if (pc.seq_q == 0u) {
        o[0] = float(q[0]) + float(k[0]) + float(v[0]);
    }
    const uint sg = gl_SubgroupID;
    const uint lane = gl_SubgroupInvocationID;
    const uint slab = gl_WorkGroupID.y;
    const uint kvs = slab / pc.group;
    const uint qb = pc.n_qb - 1u - gl_WorkGroupID.x;
    const uint t0 = qb * (NSG * 16u) + sg * 16u;       // first row of this subgroup
    if (t0 >= pc.seq_q) return;                          // uniform per subgroup
    const uint rr = lane % 16u;
    const uint part = lane / 16u;
    const uint t = t0 + rr;
    const bool row_ok = t < pc.seq_q;
    const uint i = pc.q_off + min(t, pc.seq_q - 1u);
    const uint first = first_key[slab * pc.acp_nqb + min(t, pc.seq_q - 1u) / pc.acp_bq];
    const bool row_live = row_ok && i >= first;
    const vec2 ci = cg[slab * pc.seq_k + i];
    const uint sbase = sg * 16u * SST;
    const uint pbase = sg * 16u * PST;

    F16A qf0;
    F16A qf1;
    F16A qf2;
    F16A qf3;
    const uint qoff = (slab * pc.seq_q + t0) * D;
    LOAD_R(qf0, q, qoff + 0u, D);
    LOAD_R(qf1, q, qoff + 16u, D);
    LOAD_R(qf2, q, qoff + 32u, D);
    LOAD_R(qf3, q, qoff + 48u, D);

    float acc[CPL];
    [[unroll]] for (uint c = 0; c < CPL; ++c) acc[c] = 0.0;
    float m = NEG;
    float l = 0.0;

    const uint last_t = min(t0 + 15u, pc.seq_q - 1u);
    const uint kb_end = (pc.q_off + last_t) / BN + 1u;
    const uint kb_begin = first_key[slab * pc.acp_nqb + t0 / pc.acp_bq] / BN;

    for (uint kb = kb_begin; kb < kb_end; ++kb) {
        const uint j0 = kb * BN;
        const uint kbase = (kvs * pc.seq_k + j0) * D;
        // S = Q K^T, 16 x 64, four 16-key column blocks.
        [[unroll]] for (uint n = 0; n < 4u; ++n) {
            F32M s = F32M(0.0);
            F16B kf;
            LOAD_C(kf, k, kbase + n * 16u * D + 0u, D);
            s = MMA(qf0, kf, s);
            LOAD_C(kf, k, kbase + n * 16u * D + 16u, D);
            s = MMA(qf1, kf, s);
            LOAD_C(kf, k, kbase + n * 16u * D + 32u, D);
            s = MMA(qf2, kf, s);
            LOAD_C(kf, k, kbase + n * 16u * D + 48u, D);
            s = MMA(qf3, kf, s);
            STORE_R(s, ssh, sbase + n * 16u, SST);
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();

        // Online softmax over this lane's keys jj = part + LPR * u of row rr.
        float sv[KPL];
        float mloc = NEG;
        [[unroll]] for (uint u = 0; u < KPL; ++u) {
            const uint jj = part + LPR * u;
            const uint j = j0 + jj;
            const bool ok = row_live && j <= i && j >= first && j < pc.seq_k;
            const vec2 cj = cg[slab * pc.seq_k + min(j, pc.seq_k - 1u)];
            const float x = ssh[sbase + rr * SST + jj] * pc.scale_log2
                + ((ci.x - cj.x) + (ci.y - cj.y)) * LOG2E;
            sv[u] = ok ? x : NEG;
            mloc = max(mloc, sv[u]);
        }
        [[unroll]] for (uint o2 = 16u; o2 < SG; o2 <<= 1) mloc = max(mloc, subgroupShuffleXor(mloc, o2));
        const float mnew = max(m, mloc);
        const float alpha = exp2(m - mnew);
        float lsum = 0.0;
        [[unroll]] for (uint u = 0; u < KPL; ++u) {
            const float p = sv[u] == NEG ? 0.0 : exp2(sv[u] - mnew);   // NaN stays NaN
            psh[pbase + rr * PST + part + LPR * u] = float16_t(p);
            lsum += p;
        }
        l = l * alpha + lsum;
        m = mnew;
        [[unroll]] for (uint c = 0; c < CPL; ++c) acc[c] *= alpha;
        subgroupMemoryBarrierShared();
        subgroupBarrier();

        // PV = P V, 16 x 64, into shared (reusing S's space), then added to acc.
        F16A pf0;
        F16A pf1;
        F16A pf2;
        F16A pf3;
        LOAD_R(pf0, psh, pbase + 0u, PST);
        LOAD_R(pf1, psh, pbase + 16u, PST);
        LOAD_R(pf2, psh, pbase + 32u, PST);
        LOAD_R(pf3, psh, pbase + 48u, PST);
        [[unroll]] for (uint n = 0; n < 4u; ++n) {
            F32M pv = F32M(0.0);
            F16B vf;
            LOAD_R(vf, v, kbase + 0u * D + n * 16u, D);
            pv = MMA(pf0, vf, pv);
            LOAD_R(vf, v, kbase + 16u * D + n * 16u, D);
            pv = MMA(pf1, vf, pv);
            LOAD_R(vf, v, kbase + 32u * D + n * 16u, D);
            pv = MMA(pf2, vf, pv);
            LOAD_R(vf, v, kbase + 48u * D + n * 16u, D);
            pv = MMA(pf3, vf, pv);
            STORE_R(pv, ssh, sbase + n * 16u, SST);
        }
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        [[unroll]] for (uint c = 0; c < CPL; ++c) acc[c] += ssh[sbase + rr * SST + part * CPL + c];
        subgroupMemoryBarrierShared();
        subgroupBarrier();
    }

    float lt = l;
    [[unroll]] for (uint o2 = 16u; o2 < SG; o2 <<= 1) lt += subgroupShuffleXor(lt, o2);
    if (row_ok) {
        const float inv = lt > 0.0 ? 1.0 / lt : 0.0;
        const uint ob = (slab * pc.seq_q + t) * D + part * CPL;
        [[unroll]] for (uint c = 0; c < CPL; ++c) o[ob + c] = acc[c] * inv;
        if (part == 0u) lse[slab * pc.seq_q + t] = lt > 0.0 ? (m + log2(lt)) / LOG2E : -1.0 / 0.0;
        if (row_live && !(lt > 0.0 && lt <= 3.4e38 && abs(m) <= 3.4e38)) flag[0] = 1u;
    }
}
