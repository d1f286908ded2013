// The attention inputs of one block from its projections (spec sections 3.2-3.5, 6) for
// token t of a chunk of n and head h, on 64 threads (attn_pre.comp, head_step.comp):
//   k = a k_raw[t-1] + (1 - a) k_raw[t], a = sigmoid(x.Ws) (token shift; k_raw[-1] is the
//   stream's shift state), the same for v; q and k GroupRMSNorm-ed per head (eps qk_eps)
//   when QKN > 0; log f = logsigmoid(x.Wf + b).
// P rows (n x PW floats): [q D | k_raw D | v_raw D | k shift H | v shift H | gate H | og D].
// Writes q, k, v head-major ([H][n][HD]) for the attention kernels, log f [n][H], and the
// norms (|q|, |k|) [n][H] after the QK-norm (for bounds observed without one).
// The includer declares the specialization constants H, HD, KSHIFT, VSHIFT, QKN, includes
// act.glsl and declares the buffers P, state ([k_raw D | v_raw D] of the token before),
// nw ([q_norm | k_norm], D or HD each), fbias [H], qo, kx, vx, lf, nrm (vec2).
const uint D = H * HD;
const uint PW = 4u * D + 3u * H;
const uint PER = (HD + 63u) / 64u;             // elements per thread

shared float red[2][64];

float raw(uint t, uint off, uint c) { return P[t * PW + off + c]; }

float shifted(uint t, uint off, uint soff, uint aoff, uint h, uint c) {
    const float a = sigmoid_(P[t * PW + aoff + h]);
    const float prev = t == 0u ? state[soff + c] : raw(t - 1u, off, c);
    return a * prev + (1.0 - a) * raw(t, off, c);
}

// Call from uniform control flow (it synchronizes the workgroup).
void attn_pre_row(uint t, uint h, uint n, float qk_eps) {
    const uint tid = gl_LocalInvocationID.x;
    float q[PER], k[PER], v[PER];
    float sq = 0.0, sk = 0.0;
    for (uint e = 0; e < PER; ++e) {
        const uint i = tid + 64u * e;
        if (i >= HD) break;
        const uint c = h * HD + i;
        q[e] = raw(t, 0u, c);
        k[e] = KSHIFT != 0u ? shifted(t, D, 0u, 3u * D, h, c) : raw(t, D, c);
        v[e] = VSHIFT != 0u ? shifted(t, 2u * D, D, 3u * D + H, h, c) : raw(t, 2u * D, c);
        sq += q[e] * q[e];
        sk += k[e] * k[e];
    }
    red[0][tid] = sq;
    red[1][tid] = sk;
    barrier();
    for (uint s = 32u; s > 0u; s >>= 1) {
        if (tid < s) {
            red[0][tid] += red[0][tid + s];
            red[1][tid] += red[1][tid + s];
        }
        barrier();
    }
    float rq = 1.0, rk = 1.0;
    if (QKN != 0u) {
        rq = 1.0 / sqrt(red[0][0] / float(HD) + qk_eps);
        rk = 1.0 / sqrt(red[1][0] / float(HD) + qk_eps);
    }
    const uint wn = QKN == 2u ? HD : D;       // k_norm's offset in nw
    const uint wh = QKN == 2u ? 0u : h * HD;  // this head's slice
    float nq = 0.0, nk = 0.0;
    for (uint e = 0; e < PER; ++e) {
        const uint i = tid + 64u * e;
        if (i >= HD) break;
        float qv = q[e], kv = k[e];
        if (QKN != 0u) {
            qv = qv * rq * nw[wh + i];
            kv = kv * rk * nw[wn + wh + i];
        }
        nq += qv * qv;
        nk += kv * kv;
        const uint o = (h * n + t) * HD + i;
        qo[o] = qv;
        kx[o] = kv;
        vx[o] = v[e];
    }
    barrier();
    red[0][tid] = nq;
    red[1][tid] = nk;
    barrier();
    for (uint s = 32u; s > 0u; s >>= 1) {
        if (tid < s) {
            red[0][tid] += red[0][tid + s];
            red[1][tid] += red[1][tid + s];
        }
        barrier();
    }
    if (tid == 0u) {
        lf[t * H + h] = logsigmoid_(P[t * PW + 3u * D + 2u * H + h] + fbias[h]);
        nrm[t * H + h] = sqrt(vec2(red[0][0], red[1][0]));
    }
}
