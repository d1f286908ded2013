#!/usr/bin/env python3
"""auto/best per cell of `foxedge bench --out` JSON files, with the 90% bootstrap interval
that `foxedge bench` now prints (the same method and seed as `ratio_interval` in
src/cli/bench.rs: rounds drawn with replacement, the same rounds for best and auto, 2000
resamples, 5th and 95th percentiles), and the same for the control pairs.

    python3 docs/results/ratio_intervals.py docs/results/*/run7*.json
"""
import json
import sys

MASK = (1 << 64) - 1


def quantile(s, q):
    n = len(s)
    if n == 1:
        return s[0]
    x = min(max(q, 0.0), 1.0) * (n - 1)
    i = int(x)
    f = x - i
    j = min(i + 1, n - 1)
    return s[i] * (1 - f) + s[j] * f


def interval(best, auto):
    n = min(len(best), len(auto))
    if n < 2:
        return float("nan"), float("nan")
    rng = 0x2545F4914F6CDD1D
    ratios = []
    for _ in range(2000):
        b, a = [], []
        for _ in range(n):
            rng ^= (rng << 13) & MASK
            rng ^= rng >> 7
            rng ^= (rng << 17) & MASK
            j = rng % n
            b.append(best[j])
            a.append(auto[j])
        b.sort()
        a.sort()
        ratios.append(quantile(b, 0.5) / quantile(a, 0.5))
    ratios.sort()
    return quantile(ratios, 0.05), quantile(ratios, 0.95)


for path in sys.argv[1:]:
    cells = json.load(open(path))["cells"]
    by = {(c["op"], c["len"], c["acp"], c["backend"]): c for c in cells}
    print(f"# {path}")
    for (op, n, acp, b), c in by.items():
        if b != "auto":
            continue
        cand = [by[k] for k in [(op, n, acp, x) for x in ("cpu", "vulkan", "hybrid")] if k in by]
        best = min(cand, key=lambda x: x["seconds"])
        lo, hi = interval(best["samples"], c["samples"])
        line = f"{op} {n} {'acp' if acp else 'dense'}: auto/best {best['seconds'] / c['seconds']:.3f} [{lo:.3f}-{hi:.3f}]"
        for one, two in (("cpu", "cpu2"), ("vulkan", "vulkan2")):
            if (op, n, acp, two) in by:
                x, y = by[(op, n, acp, one)], by[(op, n, acp, two)]
                lo, hi = interval(x["samples"], y["samples"])
                line += f"; {one}/{two} {x['seconds'] / y['seconds']:.3f} [{lo:.3f}-{hi:.3f}]"
        print(line)
