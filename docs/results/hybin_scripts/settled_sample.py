# cf.py TRACE.err.gz...: counterfactual of judging a split re-check's sample at its settled CPU side.
# For each split re-check after > 50 calls without a split: the sample (2nd call) as it ran and as
# judged (CPU side at the median CPU-side factor of the class's earlier warm splits at that head count,
# 3rd call of a run on), against the median of the last 20 GPU calls before it, and the split's steady
# median (10th call of a run on, same head count, whole trace) against the same GPU median.
import gzip, re, sys
from collections import defaultdict
def med(a): a = sorted(a); return a[len(a) // 2] if a else float('nan')
rows = []
for f in sys.argv[1:]:
    classes = defaultdict(list); pend = {}
    for line in gzip.open(f, 'rt'):
        if not line.startswith('[auto] ('): continue
        key = line[7:line.index(')') + 1]
        m = re.search(r'-> (\w+) \((\w+) by [\d.]+, (\d+) gpu heads', line)
        if m: pend[key] = int(m.group(3)); continue
        m = re.search(r' ran (\w+): ([\d.]+) ms', line)
        if not m: continue
        s = re.search(r'sides cpu ([\d.]+) ms = ([\d.]+) x, gpu ([\d.]+) ms = ([\d.]+) x', line)
        sd = tuple(float(s.group(i)) for i in (1, 2, 3, 4)) if s else None
        classes[key].append((m.group(1), float(m.group(2)), pend.get(key, -1), sd))
    for key, calls in classes.items():
        prev, pos, last = None, 0, None
        posl = []
        for i, c in enumerate(calls):
            pos = pos + 1 if c[0] == prev else 1; prev = c[0]; posl.append(pos)
        steady = defaultdict(list)
        for i, c in enumerate(calls):
            if c[0] == 'Split' and posl[i] >= 10: steady[c[2]].append(c[1])
        last = None
        for i, c in enumerate(calls):
            if c[0] != 'Split': continue
            if posl[i] == 1: gap = i - last - 1 if last is not None else -1
            last = i
            if posl[i] != 2 or gap <= 50 or not c[3]: continue
            h = c[2]
            prior = [x[3][1] for j, x in enumerate(calls[:i - 1]) if x[0] == 'Split' and x[2] == h and posl[j] >= 3 and x[3]]
            if len(prior) < 5: continue
            fc = med(prior[-25:])
            cpu_ms, rc, gpu_ms, rg = c[3]
            settled = min(cpu_ms, cpu_ms / rc * fc)
            judged = c[1] - (max(cpu_ms, gpu_ms) - max(settled, gpu_ms))
            gpus = [x[1] for x in calls[:i] if x[0] == 'Gpu'][-20:]
            if len(gpus) < 5 or h not in steady: continue
            rows.append((f.split('/')[-1], key, h, c[1] / med(gpus), judged / med(gpus), med(steady[h]) / med(gpus)))
print('trace class heads | sample/gpu as run | judged/gpu | steady split/gpu')
for r in rows: print('%s %s %dh | %.2f | %.2f | %.2f' % r)
n = len(rows)
print(f'{n} samples; beat the GPU (< 1/1.03): as run {sum(r[3] < 1/1.03 for r in rows)}, judged {sum(r[4] < 1/1.03 for r in rows)}; steady split faster than the GPU in {sum(r[5] < 1 for r in rows)}')
