#!/usr/bin/env python3
# cold_heads.py TRACE.err.gz...: each split re-check after > 50 calls without a split: whether its
# first two calls ran the same GPU head count, and each side's factor (CPU, then GPU) at calls 1, 2
# and 3 over the class's steady factor at that head count (median from the 10th call of a run of
# splits on).
import sys
from collections import defaultdict
from autotrace import calls, med, positions

same = total = 0
at = {side: ([], [], []) for side in (1, 3)}
for f in sys.argv[1:]:
    for key, cs in calls(f).items():
        pos = positions(cs)
        steady = {side: defaultdict(list) for side in at}
        for c, p in zip(cs, pos):
            if c[0] == 'Split' and p >= 10 and c[3]:
                for side in at:
                    steady[side][c[2]].append(c[3][side])
        st = {side: {h: med(v) for h, v in by.items() if len(v) >= 5} for side, by in steady.items()}
        last, runs = None, []
        for i, (c, p) in enumerate(zip(cs, pos)):
            if c[0] != 'Split':
                continue
            if p == 1:
                runs.append((i - last - 1 if last is not None else -1, []))
            if p <= 3:
                runs[-1][1].append(c)
            last = i
        for gap, run in runs:
            if gap <= 50 or len(run) < 2:
                continue
            total += 1
            same += run[0][2] == run[1][2]
            for j, c in enumerate(run):
                for side in at:
                    if c[3] and c[2] in st[side]:
                        at[side][j].append(c[3][side] / st[side][c[2]])
print(f'{total} re-checks after > 50 calls without a split; same GPU head count in calls 1 and 2: {same}')
for side, name in ((1, 'CPU'), (3, 'GPU')):
    for call, a in zip(('1st', '2nd', '3rd'), at[side]):
        a = sorted(a)
        if a:
            print(f'{call} call: {name} side factor / steady: n {len(a)}, median {med(a):.2f}, '
                  f'p10 {a[len(a) // 10]:.2f}, p90 {a[9 * len(a) // 10]:.2f}')
