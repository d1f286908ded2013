#version 450
// Greedy selection on the device: out = (index, value bits) of the largest logit, the
// lowest index among ties (NaN never wins). One workgroup.
layout(local_size_x = 256) in;

layout(std430, set = 0, binding = 0) readonly buffer Lb { float logits[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Ob { uint outv[]; };

layout(push_constant) uniform Push {
    uint n;
} pc;

shared float sv[256];
shared uint si[256];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    float best = uintBitsToFloat(0xff800000u);
    uint bi = 0xffffffffu;
    for (uint i = tid; i < pc.n; i += 256u) {
        const float v = logits[i];
        if (v > best || (bi == 0xffffffffu && !isnan(v))) {
            best = v;
            bi = i;
        }
    }
    sv[tid] = best;
    si[tid] = bi;
    barrier();
    for (uint s = 128u; s > 0u; s >>= 1) {
        if (tid < s) {
            const float v = sv[tid + s];
            const uint j = si[tid + s];
            if (j != 0xffffffffu && (si[tid] == 0xffffffffu || v > sv[tid] || (v == sv[tid] && j < si[tid]))) {
                sv[tid] = v;
                si[tid] = j;
            }
        }
        barrier();
    }
    if (tid == 0u) {
        outv[0] = si[0];
        outv[1] = floatBitsToUint(sv[0]);
    }
}
