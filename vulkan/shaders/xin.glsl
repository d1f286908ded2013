// The input vector of a decode matrix-vector product, transformed as it is read, so that
// the op before the product needs no dispatch of its own (set XIN by specialization):
//   XIN 0: x as stored;
//   XIN 1: RMSNorm (spec section 3): x_i * r * nw_i, r = 1 / sqrt(mean(x^2) + eps) over
//          the K inputs, every workgroup recomputing sum(x^2) (K floats, cache-resident);
//   XIN 2 / 3: the MLP's gated activation (spec section 3.9): act(x_i) * x_{K+i}, act =
//          SiLU / sigmoid, x holding [gate K | up K].
// The includer declares `vec4 x[]` (binding 1), `shared float red[WGS]` (WGS a power of
// two), K (a multiple of 4) and includes act.glsl; binding 3 is the norm weight (XIN 1;
// otherwise any buffer).
layout(constant_id = 8) const uint XIN = 0;
layout(constant_id = 9) const uint EPS_BITS = 0;  // eps of XIN 1, f32 bits

layout(std430, set = 0, binding = 3) readonly buffer Nb { vec4 nw[]; };

float xin_r = 1.0;

// Computes r for XIN 1 from x[x_off4 ..] (vec4 units); call once from uniform control flow
// before the first xin() and before red is used.
void xin_setup(uint x_off4) {
    if (XIN != 1u) return;
    const uint tid = gl_LocalInvocationIndex;
    float s = 0.0;
    for (uint c = tid; c < K / 4u; c += WGS) {
        const vec4 v = x[x_off4 + c];
        s += dot(v, v);
    }
    red[tid] = s;
    barrier();
    for (uint k = WGS / 2u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    xin_r = 1.0 / sqrt(red[0] / float(K) + uintBitsToFloat(EPS_BITS));
    barrier();
}

vec4 act4(vec4 g) {
    return XIN == 2u ? vec4(silu_(g.x), silu_(g.y), silu_(g.z), silu_(g.w))
                     : vec4(sigmoid_(g.x), sigmoid_(g.y), sigmoid_(g.z), sigmoid_(g.w));
}

// Input floats 4c .. 4c+3 (x from vec4 x_off4).
vec4 xin(uint x_off4, uint c) {
    if (XIN == 0u) return x[x_off4 + c];
    if (XIN == 1u) return x[x_off4 + c] * xin_r * nw[c];
    return act4(x[x_off4 + c]) * x[x_off4 + K / 4u + c];
}
