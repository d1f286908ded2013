#!/usr/bin/env python3
# settled_sample.py TRACE.err.gz...: a split re-check's sample (its 2nd call, after > 50 calls
# without a split) as it ran and as judged with its CPU side at the median CPU-side factor of the
# class's earlier warm splits at that head count (3rd call of a run on, last 25), each over the
# median of the GPU plan's last 20 calls before it; and the split's steady median (10th call of a
# run on, same head count, whole trace) over the same GPU median. With --both the GPU side is
# judged at its settled factor too.
import sys
from collections import defaultdict
from autotrace import calls, med, positions

both = '--both' in sys.argv
rows = []
for f in [a for a in sys.argv[1:] if a != '--both']:
    for key, cs in calls(f).items():
        pos = positions(cs)
        steady = defaultdict(list)
        for c, p in zip(cs, pos):
            if c[0] == 'Split' and p >= 10:
                steady[c[2]].append(c[1])
        last = gap = None
        for i, (c, p) in enumerate(zip(cs, pos)):
            if c[0] != 'Split':
                continue
            if p == 1:
                gap = i - last - 1 if last is not None else -1
            last = i
            if p != 2 or gap <= 50 or not c[3]:
                continue
            h = c[2]
            prior = [x[3] for x, q in zip(cs[:i - 1], pos) if x[0] == 'Split' and x[2] == h and q >= 3 and x[3]]
            gpus = [x[1] for x in cs[:i] if x[0] == 'Gpu'][-20:]
            if len(prior) < 5 or len(gpus) < 5 or h not in steady:
                continue
            cpu_ms, rc, gpu_ms, rg = c[3]
            cpu_at = min(cpu_ms, cpu_ms / rc * med([x[1] for x in prior[-25:]]))
            gpu_at = min(gpu_ms, gpu_ms / rg * med([x[3] for x in prior[-25:]])) if both else gpu_ms
            judged = c[1] - (max(cpu_ms, gpu_ms) - max(cpu_at, gpu_at))
            g = med(gpus)
            rows.append((f.split('/')[-1], key, h, c[1] / g, judged / g, med(steady[h]) / g))
print('trace class heads | sample/gpu as run | judged/gpu | steady split/gpu')
for r in rows:
    print('%s %s %dh | %.2f | %.2f | %.2f' % r)
win = lambda x: x < 1 / 1.03
print(f'{len(rows)} samples; beat the GPU (by the 3% hysteresis): as run {sum(win(r[3]) for r in rows)}, '
      f'judged {sum(win(r[4]) for r in rows)} (of them faster when steady: '
      f'{sum(win(r[4]) and r[5] < 1 for r in rows)}, slower: {sum(win(r[4]) and r[5] >= 1 for r in rows)}); steady split faster than the GPU in {sum(r[5] < 1 for r in rows)}')
