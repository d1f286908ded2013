#version 450
// RMSNorm of rows: y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w (spec section 3), f32.
// One workgroup per row.
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint D = 256;

layout(std430, set = 0, binding = 0) readonly buffer Xb { float x[]; };
layout(std430, set = 0, binding = 1) readonly buffer Wb { float w[]; };
layout(std430, set = 0, binding = 2) writeonly buffer Yb { float y[]; };

layout(push_constant) uniform Push {
    float eps;
} pc;

shared float red[64];

void main() {
    const uint t = gl_WorkGroupID.x;
    const uint tid = gl_LocalInvocationID.x;
    float s = 0.0;
    for (uint i = tid; i < D; i += 64u) s += x[t * D + i] * x[t * D + i];
    red[tid] = s;
    barrier();
    for (uint k = 32u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    const float r = 1.0 / sqrt(red[0] / float(D) + pc.eps);
    for (uint i = tid; i < D; i += 64u) y[t * D + i] = x[t * D + i] * r * w[i];
}
