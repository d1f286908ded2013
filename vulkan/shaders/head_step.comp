#version 450
// One decode token's per-head work between its projections and its attention, for up to
// SLOTS heads of one layer (head pc.h0 + slot, pc.h0 a multiple of SLOTS; the host binds as
// many as the device allows, all the layer's heads where it can), one workgroup of 64
// threads each:
//
// 0. The attention inputs (attn_pre.glsl, token 0 of 1): q, k, v, log f and the norms;
//    then the head's columns of the layer's shift state become this token's raw k, v
//    (each thread rewrites the state words it alone read).
// 1. Gates. c_t = c_{t-1} + max(log f_t, -1e4) (foxedge_core::gate::GateStream
//    ::push) as a double-float pair (hi, lo), as the attention kernels take c: c_{t-1} comes
//    from the host's f64 stream (split into hi + lo, exact to 2^-48 relative) and the sum
//    is an exact two-sum, renormalized. c_t goes to the decode query (group-padded: head
//    h at (h / SLOTS) * pc.qstride + h % SLOTS), into the meta of the head's new cache row
//    and into the step's readback (ctout, at the head's counts index). Evictions (foxedge_core
//    RetentionPolicy::next_evictions): the host lists the head's candidates in eviction
//    order with thresholds (double-float, non-increasing); the step evicts the k
//    candidates with c_t <= threshold (a thread per candidate). Each candidate has one
//    operation among the step's operations (its swap-delete move, or nothing); those past
//    k are skipped, the token's row goes to slot live - k, and the query attends
//    live - k + 1 rows: written into the put operation, the ACP and decode metadata, with
//    the ACP threshold for that many rows (a table of k + 1 double-floats, when given) and
//    k in the step's counts. A non-finite log gate sets flag[0] (reported as non-finite activations, as
//    attention reports them).
// 2. Row operations (rowops.glsl), in order: the host's moves and metas, the evictions,
//    the token's row.
// 3. ACP (foxedge_core::contract::acp): a block of pc.block rows is skipped when
//    c_t - min_j c_j < delta (every pruned weight is then below eps / live); eight threads
//    per block. delta: mode 0 none (every block kept); mode 1 par.xy, a double-float from the
//    host (the certified bound U); mode 2 par.x - 2 U with U = par.z |q| max(par.y, |k|)
//    (observed norms: par.y the head's largest earlier |k|, par.z the softmax scale,
//    par.x = ln eps - ln live). Writes a flag per block (1 = attend) at kept[info.z + b] and
//    (kept blocks, kept rows) at stats[info.w & 0xffff].xy.
//
// The head's inputs are words of the step's host words w: c_{t-1} (hi, lo) at
// pc.cprev_at + 2h, and at pc.rc_at + 12h the indices (put op, candidates, their first op,
// thresholds) (live, ACP info, decode qinfo, ACP table) (ACP par, counts index, range, -),
// a range being (first op counted in 8-word operations from pc.var_at, operations, head,
// cap) and an ACP info (live, cap, kept0, counts index | head << 16).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : enable
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint H = 4;
layout(constant_id = 1) const uint HD = 64;
layout(constant_id = 2) const uint KSHIFT = 1;
layout(constant_id = 3) const uint VSHIFT = 1;
layout(constant_id = 4) const uint QKN = 1;    // 0 none, 1 one weight per head, 2 shared
layout(constant_id = 5) const uint SLOTS = 8;  // head buffers per dispatch
#include "act.glsl"

layout(std430, set = 0, binding = 0) coherent buffer Hb { uint x[]; } hb[SLOTS];
layout(std430, set = 0, binding = 1) readonly buffer Pb { float P[]; };
layout(std430, set = 0, binding = 2) buffer Sb { float state[]; };             // [k_raw D | v_raw D]
layout(std430, set = 0, binding = 3) readonly buffer Nb { float nw[]; };
layout(std430, set = 0, binding = 4) readonly buffer Gb { float fbias[]; };
layout(std430, set = 0, binding = 5) writeonly buffer Qb { float qo[]; };      // [H][HD]
layout(std430, set = 0, binding = 6) coherent buffer Kb { float kx[]; };       // [H][HD]
layout(std430, set = 0, binding = 7) coherent buffer Vb { float vx[]; };       // [H][HD]
layout(std430, set = 0, binding = 8) coherent buffer Lb { float lf[]; };       // [H]
layout(std430, set = 0, binding = 9) coherent buffer Rb { vec2 nrm[]; };       // [H] (|q|, |k|)
layout(std430, set = 0, binding = 10) writeonly buffer Qc { vec2 qc[]; };      // padded [H]
layout(std430, set = 0, binding = 11) coherent buffer Up { uint w[]; };        // the step's host words
layout(std430, set = 0, binding = 12) writeonly buffer Kp { uint kept[]; };
layout(std430, set = 0, binding = 13) buffer St { uvec4 stats[]; };            // [layer H] (kept blocks, kept rows, k, 0)
layout(std430, set = 0, binding = 14) buffer Fl { uint flag[]; };
layout(std430, set = 0, binding = 15) writeonly buffer Ct { vec2 ctout[]; };   // [layer H]

layout(push_constant) uniform Push {
    uint h0;
    uint qstride;  // vec2 per group of SLOTS heads in qc
    uint var_at;
    uint cprev_at;
    uint rc_at;
    uint block;
    uint mode;
    float qk_eps;
} pc;

#include "attn_pre.glsl"
#include "rowops.glsl"

const uint NONE = 0xffffffffu;

// a <= b and a < b for double-floats (hi, lo); b.x = +inf compares above every finite a.
bool le(vec2 a, vec2 b) { return a.x < b.x || (a.x == b.x && a.y <= b.y); }
bool less(vec2 a, vec2 b) { return a.x < b.x || (a.x == b.x && a.y < b.y); }

uvec4 words4(uint i) { return uvec4(w[i], w[i + 1u], w[i + 2u], w[i + 3u]); }

shared vec2 s_ct;
shared uint s_k;
shared vec2 s_min[64];
shared uint s_blocks;
shared uint s_rows;

// Step 1 for head h: returns c_t.
// c_t of head h (thread 0).
vec2 gate_ct(uint h, uvec4 r2) {
    const float g = lf[h];
    if (isnan(g) || isinf(g) || g > 0.0) flag[0] = 1u;
    const precise float x = max(g, -1.0e4);
    const vec2 c = uintBitsToFloat(uvec2(w[pc.cprev_at + 2u * h], w[pc.cprev_at + 2u * h + 1u]));
    precise float s = c.x + x;
    precise float bb = s - c.x;
    precise float err = (c.x - (s - bb)) + (x - bb);
    precise float lo = c.y + err;
    precise float hi = s + lo;
    precise float lo2 = lo - (hi - s);
    const vec2 ct = vec2(hi, lo2);
    qc[(h / SLOTS) * pc.qstride + h % SLOTS] = ct;
    ctout[r2.y] = ct;
    return ct;
}

// What k evictions at c_t leave (thread 0): the token's row and the attended rows.
void gate_apply(uint k, vec2 ct, uvec4 r0, uvec4 r1, uvec4 r2) {
    const uint live = r1.x - k;
    w[r0.x + 2u] = live;
    w[r0.x + 4u] = floatBitsToUint(ct.x);
    w[r0.x + 5u] = floatBitsToUint(ct.y);
    w[r1.y] = live + 1u;
    w[r1.z] = live + 1u;
    if (r1.w != NONE) {
        w[r2.x] = w[r1.w + 2u * k];
        w[r2.x + 1u] = w[r1.w + 2u * k + 1u];
    }
    stats[r2.y].z = k;
}

void main() {
    const uint slot = gl_WorkGroupID.x;
    const uint h = pc.h0 + slot;
    const uint tid = gl_LocalInvocationID.x;
    // The head's indices (host words this dispatch never writes), loaded first so that
    // their latency overlaps step 0.
    const uint ri = pc.rc_at + 12u * h;
    const uvec4 r0 = words4(ri), r1 = words4(ri + 4u), r2 = words4(ri + 8u);
    attn_pre_row(0u, h, 1u, pc.qk_eps);
    for (uint i = tid; i < HD; i += 64u) {
        const uint c = h * HD + i;
        state[c] = P[D + c];
        state[D + c] = P[2u * D + c];
    }
    memoryBarrierBuffer();
    barrier();
    if (tid == 0u) {
        s_ct = gate_ct(h, r2);
        s_k = 0u;
        s_blocks = 0u;
        s_rows = 0u;
    }
    memoryBarrierShared();
    barrier();
    // Candidate i is evicted when c_t <= its threshold (non-increasing: a prefix); a
    // thread per candidate.
    for (uint i = tid; i < r0.y; i += 64u) {
        const vec2 t = uintBitsToFloat(uvec2(w[r0.w + 2u * i], w[r0.w + 2u * i + 1u]));
        if (le(s_ct, t)) atomicMax(s_k, i + 1u);
    }
    memoryBarrierShared();
    barrier();
    const uint k = s_k;
    if (tid == 0u) gate_apply(k, s_ct, r0, r1, r2);
    memoryBarrierBuffer();
    barrier();

    // The host's operations, the k evictions made (the other candidates' operations are
    // skipped), the token's row.
    const uvec4 rg = words4(r2.z);
    const uint n_host = rg.y - r0.y - 1u;
    for (uint i = 0u; i < n_host + k + 1u; ++i) {
        const uint op = i < n_host + k ? i : rg.y - 1u;
        const uint o = pc.var_at + 8u * (rg.x + op);
        row_op(slot, rg.w, rg.z, 1u, words4(o), words4(o + 4u), tid);
        memoryBarrierBuffer();
        barrier();
    }

    const uvec4 in4 = words4(r1.y);
    const uint live = in4.x, moff = 2u * in4.y * HD, head = in4.w >> 16u;
    const vec4 p = uintBitsToFloat(words4(r2.x));
    const vec2 ct = s_ct;
    float delta = p.x + p.y;
    if (pc.mode == 2u) {
        const vec2 qk = nrm[head];
        delta = p.x - 2.0 * (p.z * qk.x * max(p.y, qk.y));
    }
    // Eight threads a block, each the least c of its eighth of the rows (eight loads at a
    // time, issued together), then the least of the eight in shared memory.
    const uint nb = (live + pc.block - 1u) / pc.block;
    const uint part = tid % 8u;
    const uint per = (pc.block + 7u) / 8u;
    for (uint b0 = 0u; b0 < nb; b0 += 8u) {
        const uint b = b0 + tid / 8u;
        const uint j0 = b * pc.block, j1 = min(j0 + pc.block, live);
        vec2 m = vec2(uintBitsToFloat(0x7f800000u), 0.0);
        if (pc.mode != 0u && b < nb) {
            const uint lo = j0 + part * per, hi = min(lo + per, j1);
            for (uint a = lo; a < hi; a += 8u) {
                [[unroll]] for (uint u = 0u; u < 8u; ++u) {
                    const uint j = a + u;
                    if (j < hi) {
                        const vec2 cj = uintBitsToFloat(uvec2(hb[slot].x[moff + 4u * j], hb[slot].x[moff + 4u * j + 1u]));
                        if (less(cj, m)) m = cj;
                    }
                }
            }
        }
        s_min[tid] = m;
        barrier();
        for (uint k = 4u; k > 0u; k >>= 1) {
            if (part < k && less(s_min[tid + k], s_min[tid])) s_min[tid] = s_min[tid + k];
            barrier();
        }
        if (part == 0u && b < nb) {
            bool keep = true;
            if (pc.mode != 0u) {
                const vec2 mb = s_min[tid];
                const float d = (ct.x - mb.x) + (ct.y - mb.y);
                keep = pc.mode == 1u ? !((d - p.x) < p.y) : !(d < delta);
            }
            kept[in4.z + b] = keep ? 1u : 0u;
            if (keep) {
                atomicAdd(s_blocks, 1u);
                atomicAdd(s_rows, j1 - j0);
            }
        }
        barrier();
    }
    barrier();
    if (tid == 0u) stats[in4.w & 0xffffu].xy = uvec2(s_blocks, s_rows);
}
