// Weight storage formats, as u32 words (set WFMT before including):
//   WFMT 0: f32, one weight per word;
//   WFMT 1: f16, two per word, the lower half first;
//   WFMT 2: bf16 (the top 16 bits of an f32), two per word, the lower half first.
// Rows hold K weights (K a multiple of 8), so a row starts on a 16-byte boundary and a uvec4
// holds EPW whole weights of one row.
#if WFMT == 0
const uint EPW = 4;
#else
const uint EPW = 8;
#endif

// The weights of uvec4 `w`: (a, b) = weights 0..3 and 4..7 (b unused for f32).
void unpack8(uvec4 w, out vec4 a, out vec4 b) {
#if WFMT == 0
    a = uintBitsToFloat(w);
    b = vec4(0.0);
#elif WFMT == 1
    a = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
    b = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
#else
    a = uintBitsToFloat(uvec4(w.x << 16, w.x & 0xffff0000u, w.y << 16, w.y & 0xffff0000u));
    b = uintBitsToFloat(uvec4(w.z << 16, w.z & 0xffff0000u, w.w << 16, w.w & 0xffff0000u));
#endif
}

// Weight `i` of a word array.
float wone(uint word, uint half_) {
#if WFMT == 0
    return uintBitsToFloat(word);
#elif WFMT == 1
    return unpackHalf2x16(word)[half_];
#else
    return uintBitsToFloat(half_ == 0u ? word << 16 : word & 0xffff0000u);
#endif
}
