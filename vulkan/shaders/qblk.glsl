// Q8 / Q4 weights (foxedge_core::quant) in the interleaved layout foxedge_cpu packs them in
// (foxedge_cpu::linear::pack), uploaded as is, read as u32 words of the buffer `W` (declared
// by the includer), with QW set before including (8 for Q8, 4 for Q4: the words of one row's
// block). Rows come in groups of 16; a group's rows are cut into tiles of 64 weights (two
// blocks of 32, b = 0, 1), tile after tile, group after group; a tile of TILE_W words:
//   words 0..16:                  f16 scales, row j of block b at half 16 b + j;
//   word 16 + 16 QW b + 16 c + j: word c of block b of row j:
//     Q8: weights 4c .. 4c+3 of the block (i8, lowest byte first), w = d q;
//     Q4: byte t holds the level index of weight 4c+t (low nibble) and of 16+4c+t (high),
//         w = d LEVELS[index].
// Rows past the matrix and blocks past the row are zero. The 16 rows of a group read one
// word each from 64 consecutive bytes: coalesced loads.
const uint TILE_W = 16u + 32u * QW;

// foxedge_core::quant::Q4_LEVELS.
const float Q4_LEVELS[16] = float[](-110.0, -86.0, -67.0, -51.0, -37.0, -25.0, -13.0, -2.0,
                                    8.0, 19.0, 31.0, 44.0, 59.0, 77.0, 99.0, 127.0);
// The levels in shared memory: 16 floats in 16 banks, so a lookup never conflicts.
shared float lv[16];

// Fills lv; call once from uniform control flow before any lookup.
void load_levels() {
    if (gl_LocalInvocationIndex < 16u) lv[gl_LocalInvocationIndex] = Q4_LEVELS[gl_LocalInvocationIndex];
    barrier();
}

// First word of the tile holding block kb of row group g (gw: words of a group).
uint q_tile(uint gw, uint g, uint kb) {
    return g * gw + (kb / 2u) * TILE_W;
}

// The scale of block kb of row j (tile from q_tile).
float q_scale(uint tile, uint kb, uint j) {
    return unpackHalf2x16(W[tile + 8u * (kb % 2u) + j / 2u])[j % 2u];
}

// Word c of block kb of row j.
uint q_word(uint tile, uint kb, uint j, uint c) {
    return W[tile + 16u + 16u * QW * (kb % 2u) + 16u * c + j];
}

// The four i8 of a Q8 word, lowest byte first.
vec4 q8x4(uint w) {
    return vec4(ivec4(uvec4(w) << uvec4(24u, 16u, 8u, 0u)) >> 24);
}

// The levels of the four low nibbles of a Q4 word (w >> 4: the high nibbles).
vec4 q4x4(uint w) {
    return vec4(lv[w & 15u], lv[(w >> 8) & 15u], lv[(w >> 16) & 15u], lv[(w >> 24) & 15u]);
}
