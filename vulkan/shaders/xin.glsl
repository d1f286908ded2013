// The input vector of a decode matrix-vector product, transformed once per workgroup into
// shared memory, so that the op before the product needs no dispatch of its own and no row
// repeats it (set XIN by specialization):
//   XIN 0: x as stored;
//   XIN 1: RMSNorm (spec section 3): x_i r nw_i, r = 1 / sqrt(mean(x^2) + eps) over the K
//          inputs. Staged as x_i nw_i; r is a common factor of every output,
//          y_j = r sum_i W_ji (x_i nw_i), applied to the sums (xin_scale);
//   XIN 2 / 3: the MLP's gated activation (spec section 3.9): act(x_i) x_{K+i}, act =
//          SiLU / sigmoid, x holding [gate K | up K];
//   XIN 4: the attention output before o_proj (spec section 3.7, as attn_post.comp):
//          x_i r_h nw_i (PMODE bit 0: GroupRMSNorm, r_h = 1 / sqrt(mean over head h's PHD
//          inputs of x^2 + eps)) times act(g_i) (PMODE bit 1: sigmoid, bit 2: SiLU), g the
//          gate logits of the projections row pg at 3K + 3H (H = K / PHD heads). Needs
//          the whole input in one tile.
// The input is staged in tiles of XT vec4 (XT a multiple of 8; K / 4 when it fits, so one
// tile): xin_stage fills xs[0 .. n) with vec4 t0 .. t0 + n of the input.
// The includer declares `vec4 x[]` (binding 1), WGS (a power of two), K (a multiple of 4)
// and includes act.glsl; binding 3 is the norm weight (XIN 1; otherwise any buffer).
layout(constant_id = 8) const uint XIN = 0;
layout(constant_id = 9) const uint EPS_BITS = 0;  // eps of XIN 1, f32 bits
layout(constant_id = 10) const uint XT = 64;      // staged vec4 per tile
layout(constant_id = 11) const uint PHD = 64;     // XIN 4: head dim, a multiple of 4
layout(constant_id = 12) const uint PMODE = 0;    // XIN 4: norm (1) | sigmoid (2) | SiLU (4)

layout(std430, set = 0, binding = 3) readonly buffer Nb { vec4 nw[]; };
layout(std430, set = 0, binding = 4) readonly buffer Gp { float pg[]; };  // XIN 4

shared vec4 xs[XT];
shared float xhr[K / PHD];
shared float xss[WGS];
// This thread's share of sum(x^2) (XIN 1).
float xin_ss = 0.0;

vec4 act4(vec4 g) {
    return XIN == 2u ? vec4(silu_(g.x), silu_(g.y), silu_(g.z), silu_(g.w))
                     : vec4(sigmoid_(g.x), sigmoid_(g.y), sigmoid_(g.z), sigmoid_(g.w));
}

// XIN 4: stages the whole input (t0 = 0, n = K / 4).
void xin_post(uint x_off4) {
    const uint tid = gl_LocalInvocationIndex;
    const uint nh = K / PHD;
    for (uint c = tid; c < K / 4u; c += WGS) xs[c] = x[x_off4 + c];
    barrier();
    if ((PMODE & 1u) != 0u) {
        for (uint h = tid; h < nh; h += WGS) {
            float s = 0.0;
            for (uint i = 0u; i < PHD / 4u; ++i) {
                const vec4 v = xs[h * (PHD / 4u) + i];
                s += dot(v, v);
            }
            xhr[h] = 1.0 / sqrt(s / float(PHD) + uintBitsToFloat(EPS_BITS));
        }
        barrier();
    }
    for (uint c = tid; c < K / 4u; c += WGS) {
        vec4 v = xs[c];
        if ((PMODE & 1u) != 0u) v = v * xhr[4u * c / PHD] * nw[c];
        if ((PMODE & 6u) != 0u) {
            const uint g0 = 3u * K + 3u * nh + 4u * c;
            const vec4 g = vec4(pg[g0], pg[g0 + 1u], pg[g0 + 2u], pg[g0 + 3u]);
            v *= (PMODE & 2u) != 0u
                ? vec4(sigmoid_(g.x), sigmoid_(g.y), sigmoid_(g.z), sigmoid_(g.w))
                : vec4(silu_(g.x), silu_(g.y), silu_(g.z), silu_(g.w));
        }
        xs[c] = v;
    }
    barrier();
}

// Stages input vec4 t0 .. t0 + n - 1 (x from vec4 x_off4) into xs[0 .. n); call from
// uniform control flow. Ends with a barrier; the caller puts one before it when xs holds a
// tile still being read.
void xin_stage(uint x_off4, uint t0, uint n) {
    if (XIN == 4u) {
        xin_post(x_off4);
        return;
    }
    for (uint c = gl_LocalInvocationIndex; c < n; c += WGS) {
        vec4 v = x[x_off4 + t0 + c];
        if (XIN == 1u) {
            xin_ss += dot(v, v);
            v *= nw[t0 + c];
        } else if (XIN >= 2u) {
            v = act4(v) * x[x_off4 + K / 4u + t0 + c];
        }
        xs[c] = v;
    }
    barrier();
}

// The factor of every output (XIN 1: r; otherwise 1), after every tile was staged; call
// from uniform control flow.
float xin_scale() {
    if (XIN != 1u) return 1.0;
    const uint tid = gl_LocalInvocationIndex;
    xss[tid] = xin_ss;
    barrier();
    for (uint k = WGS / 2u; k > 0u; k >>= 1) {
        if (tid < k) xss[tid] += xss[tid + k];
        barrier();
    }
    return 1.0 / sqrt(xss[0] / float(K) + uintBitsToFloat(EPS_BITS));
}
