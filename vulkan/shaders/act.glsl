// Activations as foxedge's CPU path computes them (f32).
float sigmoid_(float x) {
    if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
    const float e = exp(x);
    return e / (1.0 + e);
}

float silu_(float x) { return x * sigmoid_(x); }

// ln(1 + e) for e in [0, 1], accurate for small e (the u = 1 + e correction).
float log1p_(float e) {
    const float u = 1.0 + e;
    return u == 1.0 ? e : log(u) * (e / (u - 1.0));
}

// ln sigmoid(x) = min(x, 0) - ln(1 + exp(-|x|)), as foxedge_core::gate::logsigmoid.
float logsigmoid_(float x) { return min(x, 0.0) - log1p_(exp(-abs(x))); }
