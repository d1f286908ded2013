#version 450
// ACP's decode decisions of one token on the device, by foxedge_core::contract::acp's rule:
// a block of BLOCK cache rows is skipped when c_t - min_j c_j < delta (every pruned weight
// is then below eps / live). One workgroup per head slot (up to SLOTS head buffers per
// dispatch, the cache_ops / decode layout: [cap rows of K][cap rows of V][cap meta uvec4
// (c_hi, c_lo, pos_lo, pos_hi)], f32 rows of HD words); a thread per block. delta per head:
//   mode 0: none (every block kept);
//   mode 1: par.xy, a double-float pair from the host (the certified bound U);
//   mode 2: par.x - 2 U with U = par.z * |q| * max(par.y, |k|) (observed norms: par.y the
//           head's largest earlier |k|, par.z the softmax scale, par.x = ln eps - ln live).
// Writes a flag per block (1 = attend) at kept[info.z + b] and (kept blocks, kept rows) at
// stats[info.w & 0xffff].xy.
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint HD = 64;
#define SLOTS 8

layout(std430, set = 0, binding = 0) readonly buffer Hb { uint x[]; } hb[SLOTS];
layout(std430, set = 0, binding = 1) readonly buffer Qc { vec2 qc[]; };      // [slot] c_t
layout(std430, set = 0, binding = 2) readonly buffer Nm { vec2 nrm[]; };     // [H] (|q|, |k|)
layout(std430, set = 0, binding = 3) readonly buffer In { uvec4 info[]; };   // [slot] (live, cap, kept0, stat | head << 16)
layout(std430, set = 0, binding = 4) readonly buffer Pr { vec4 par[]; };     // [slot]
layout(std430, set = 0, binding = 5) writeonly buffer Kp { uint kept[]; };
layout(std430, set = 0, binding = 6) buffer St { uvec4 stats[]; };          // [layer H] (kept blocks, kept rows, k, 0)

layout(push_constant) uniform Push {
    uint block;
    uint mode;
} pc;

shared uint s_blocks;
shared uint s_rows;

bool less(vec2 a, vec2 b) { return a.x < b.x || (a.x == b.x && a.y < b.y); }

void main() {
    const uint slot = gl_WorkGroupID.x;
    const uint tid = gl_LocalInvocationID.x;
    const uvec4 in4 = info[slot];
    const uint live = in4.x, moff = 2u * in4.y * HD, head = in4.w >> 16u;
    const vec4 p = par[slot];
    const vec2 ct = qc[slot];
    float delta = p.x + p.y;
    if (pc.mode == 2u) {
        const vec2 qk = nrm[head];
        delta = p.x - 2.0 * (p.z * qk.x * max(p.y, qk.y));
    }
    if (tid == 0u) { s_blocks = 0u; s_rows = 0u; }
    barrier();
    const uint nb = (live + pc.block - 1u) / pc.block;
    for (uint b = tid; b < nb; b += 64u) {
        const uint j0 = b * pc.block, j1 = min(j0 + pc.block, live);
        bool keep = true;
        if (pc.mode != 0u) {
            vec2 m = vec2(uintBitsToFloat(0x7f800000u), 0.0);
            for (uint j = j0; j < j1; ++j) {
                const vec2 cj = uintBitsToFloat(uvec2(hb[slot].x[moff + 4u * j], hb[slot].x[moff + 4u * j + 1u]));
                if (less(cj, m)) m = cj;
            }
            const float d = (ct.x - m.x) + (ct.y - m.y);
            keep = pc.mode == 1u ? !((d - p.x) < p.y) : !(d < delta);
        }
        kept[in4.z + b] = keep ? 1u : 0u;
        if (keep) {
            atomicAdd(s_blocks, 1u);
            atomicAdd(s_rows, j1 - j0);
        }
    }
    barrier();
    if (tid == 0u) stats[in4.w & 0xffffu].xy = uvec2(s_blocks, s_rows);
}
