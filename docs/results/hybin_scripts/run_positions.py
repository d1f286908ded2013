#!/usr/bin/env python3
# run_positions.py TRACE.err.gz...: per auto class, plan switches per 1000 calls, and each plan's
# median call time by its position in a run of that plan (1-5, 6-20, 21+), with the excess of
# every run's first 2 calls over the plan's median at calls 6+ as a share of the class's time.
import sys
from collections import defaultdict
from autotrace import calls, med, positions

for f in sys.argv[1:]:
    for key, cs in calls(f).items():
        pos = positions(cs)
        switches = sum(1 for q in pos[1:] if q == 1)
        by, steady = defaultdict(list), defaultdict(list)
        for c, q in zip(cs, pos):
            by[(c[0], q if q <= 5 else (6 if q <= 20 else 21))].append(c[1])
            if q >= 6:
                steady[c[0]].append(c[1])
        m = {k: med(v) for k, v in steady.items()}
        extra = sum(c[1] - m[c[0]] for c, q in zip(cs, pos) if q <= 2 and c[0] in m)
        total = sum(c[1] for c in cs)
        print(f"{f.split('/')[-1]} {key}: {len(cs)} calls, {switches} switches "
              f"({1000 * switches / len(cs):.0f} per 1000), first 2 calls of runs "
              f"+{100 * extra / total:.1f}% of the class's time")
        for kind in sorted({c[0] for c in cs}):
            cells = [f"{b if b < 21 else '21+'}{'-20' if b == 6 else ''}: {med(by[(kind, b)]):.3f} ms (n {len(by[(kind, b)])})"
                     for b in (1, 2, 3, 4, 5, 6, 21) if by[(kind, b)]]
            print(f"    {kind:5} " + ", ".join(cells))
