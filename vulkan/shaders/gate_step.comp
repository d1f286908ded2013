#version 450
// One decode token's cumulative forget gates on the device: c_t = c_{t-1} + max(log f_t,
// -1e4) per head (foxedge_core::gate::GateStream::push), carried as a double-float pair
// (hi, lo) as the attention kernels take c. c_{t-1} comes from the host's f64 stream
// (split into hi + lo, exact to 2^-48 relative); the sum is an exact two-sum renormalized
// into a new pair, so c_t carries the same precision. Writes c_t for the decode query
// (group-padded: head h at (h / 8) * pc.qstride + h % 8) and into the meta of the head's
// new cache row (the put operation at put_at[h], none when ~0). A non-finite log gate sets
// flag[0] (reported as non-finite activations, as attention reports them).
layout(local_size_x = 64) in;

layout(std430, set = 0, binding = 0) readonly buffer Lf { float lf[]; };      // [H]
layout(std430, set = 0, binding = 1) readonly buffer Cp { vec2 cprev[]; };    // [H] (hi, lo)
layout(std430, set = 0, binding = 2) writeonly buffer Qc { vec2 qc[]; };      // padded [H]
layout(std430, set = 0, binding = 3) buffer Ops { uvec4 ops[]; };             // cache_ops words
layout(std430, set = 0, binding = 4) readonly buffer Pa { uint put_at[]; };   // [H]
layout(std430, set = 0, binding = 5) buffer Fl { uint flag[]; };

layout(push_constant) uniform Push {
    uint heads;
    uint qstride;  // vec2 per group of 8 heads in qc
} pc;

void main() {
    const uint h = gl_GlobalInvocationID.x;
    if (h >= pc.heads) return;
    const float g = lf[h];
    if (isnan(g) || isinf(g) || g > 0.0) flag[0] = 1u;
    const precise float x = max(g, -1.0e4);
    const vec2 c = cprev[h];
    // Two-sum of hi and x (exact), then the low parts, renormalized.
    precise float s = c.x + x;
    precise float bb = s - c.x;
    precise float err = (c.x - (s - bb)) + (x - bb);
    precise float lo = c.y + err;
    precise float hi = s + lo;
    precise float lo2 = lo - (hi - s);
    qc[(h / 8u) * pc.qstride + h % 8u] = vec2(hi, lo2);
    const uint at = put_at[h];
    if (at != 0xffffffffu) {
        ops[at].x = floatBitsToUint(hi);
        ops[at].y = floatBitsToUint(lo2);
    }
}
