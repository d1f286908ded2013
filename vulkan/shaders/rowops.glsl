// One row operation on a resident cache head (cache_ops.comp, head_step.comp), in the
// decode kernel's head layout (decode.glsl: [cap rows of K][cap rows of V][cap meta uvec4
// (c_hi, c_lo, pos_lo, pos_hi)], f32 rows of HD words), op = (a, b):
//   kind 0, move: row a.y -> row a.z (K, V and meta);
//   kind 1, put: K and V of token a.y of a chunk of n (kx, vx head-major [H][n][HD], this
//        head `head`) -> row a.z, with meta b;
//   kind 2, meta: row a.z's meta = b (a re-based c);
//   kind 3: nothing (an eviction a decode step decided against).
// The includer declares hb[] (uint x[] each), kx[], vx[] and HD.

// Column c (< HD) of the op's K and V rows, and meta word c if c < 4.
void row_op_col(uint slot, uint cap, uint head, uint n, uvec4 a, uvec4 b, uint c) {
    const uint voff = cap * HD;
    const uint moff = 2u * cap * HD;
    if (a.x == 0u) {
        if (c < HD) {
            hb[slot].x[a.z * HD + c] = hb[slot].x[a.y * HD + c];
            hb[slot].x[voff + a.z * HD + c] = hb[slot].x[voff + a.y * HD + c];
        }
        if (c < 4u) hb[slot].x[moff + 4u * a.z + c] = hb[slot].x[moff + 4u * a.y + c];
    } else if (a.x == 2u) {
        if (c < 4u) hb[slot].x[moff + 4u * a.z + c] = b[c];
    } else if (a.x == 1u) {
        if (c < HD) {
            const uint src = (head * n + a.y) * HD;
            hb[slot].x[a.z * HD + c] = floatBitsToUint(kx[src + c]);
            hb[slot].x[voff + a.z * HD + c] = floatBitsToUint(vx[src + c]);
        }
        if (c < 4u) hb[slot].x[moff + 4u * a.z + c] = b[c];
    }
}

// The whole op on 64 threads (tid: columns tid, tid + 64, ...); the includer puts a buffer
// barrier after each operation.
void row_op(uint slot, uint cap, uint head, uint n, uvec4 a, uvec4 b, uint tid) {
    for (uint c = tid; c < max(HD, 4u); c += 64u) row_op_col(slot, cap, head, n, a, b, c);
}
