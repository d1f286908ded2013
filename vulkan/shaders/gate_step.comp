#version 450
// One decode token's cumulative forget gates and evictions on the device.
//
// c_t = c_{t-1} + max(log f_t, -1e4) per head (foxedge_core::gate::GateStream::push), as a
// double-float pair (hi, lo) as the attention kernels take c: c_{t-1} comes from the host's
// f64 stream (split into hi + lo, exact to 2^-48 relative) and the sum is an exact two-sum,
// renormalized. c_t goes to the decode query (group-padded: head h at
// (h / 8) * pc.qstride + h % 8), into the meta of the head's new cache row and into the
// step's readback (ct, at the head's counts index).
//
// Evictions (foxedge_core RetentionPolicy::next_evictions): the host lists a head's
// candidates in eviction order with thresholds (double-float, non-increasing); the step
// evicts the k candidates with c_t <= threshold. Each candidate has one operation among
// the step's cache_ops words (its swap-delete move, or nothing); those past k become
// nothing (kind 3), the token's row goes to slot live - k, and the query attends
// live - k + 1 rows: written into the put operation, the ACP and decode metadata, with the
// ACP threshold for that many rows (a table of k + 1 double-floats, when given) and k in
// the step's counts. A non-finite log gate sets flag[0] (reported as non-finite
// activations, as attention reports them).
layout(local_size_x = 64) in;

layout(std430, set = 0, binding = 0) readonly buffer Lf { float lf[]; };      // [H]
layout(std430, set = 0, binding = 1) readonly buffer Cp { vec2 cprev[]; };    // [H] (hi, lo)
layout(std430, set = 0, binding = 2) writeonly buffer Qc { vec2 qc[]; };      // padded [H]
layout(std430, set = 0, binding = 3) buffer Up { uint w[]; };                 // the step's host words
layout(std430, set = 0, binding = 4) readonly buffer Rc { uvec4 rc[]; };      // [H][3] word indices into w
layout(std430, set = 0, binding = 5) buffer St { uvec4 stats[]; };            // [layer H] (.., .., k, 0)
layout(std430, set = 0, binding = 6) buffer Fl { uint flag[]; };
layout(std430, set = 0, binding = 7) writeonly buffer Ct { vec2 ctout[]; };      // [layer H]

layout(push_constant) uniform Push {
    uint heads;
    uint qstride;  // vec2 per group of 8 heads in qc
} pc;

const uint NONE = 0xffffffffu;

// a <= b for double-floats (hi, lo); b.x = +inf compares above every finite a.
bool le(vec2 a, vec2 b) { return a.x < b.x || (a.x == b.x && a.y <= b.y); }

void main() {
    const uint h = gl_GlobalInvocationID.x;
    if (h >= pc.heads) return;
    // (put op, candidates, their first op, thresholds) (live, ACP info.x, decode qinfo.x,
    // ACP table) (ACP par.xy, counts index, -, -)
    const uvec4 r0 = rc[3u * h], r1 = rc[3u * h + 1u], r2 = rc[3u * h + 2u];
    const float g = lf[h];
    if (isnan(g) || isinf(g) || g > 0.0) flag[0] = 1u;
    const precise float x = max(g, -1.0e4);
    const vec2 c = cprev[h];
    precise float s = c.x + x;
    precise float bb = s - c.x;
    precise float err = (c.x - (s - bb)) + (x - bb);
    precise float lo = c.y + err;
    precise float hi = s + lo;
    precise float lo2 = lo - (hi - s);
    const vec2 ct = vec2(hi, lo2);
    qc[(h / 8u) * pc.qstride + h % 8u] = ct;
    ctout[r2.y] = ct;

    uint k = 0u;
    for (uint i = 0u; i < r0.y; ++i) {
        const vec2 t = uintBitsToFloat(uvec2(w[r0.w + 2u * i], w[r0.w + 2u * i + 1u]));
        if (le(ct, t)) k = i + 1u;
    }
    for (uint i = k; i < r0.y; ++i) w[r0.z + 8u * i] = 3u;
    const uint live = r1.x - k;
    w[r0.x + 2u] = live;
    w[r0.x + 4u] = floatBitsToUint(hi);
    w[r0.x + 5u] = floatBitsToUint(lo2);
    w[r1.y] = live + 1u;
    w[r1.z] = live + 1u;
    if (r1.w != NONE) {
        w[r2.x] = w[r1.w + 2u * k];
        w[r2.x + 1u] = w[r1.w + 2u * k + 1u];
    }
    stats[r2.y].z = k;
}
