# cold3.py TRACE.err.gz...: for each split re-check after > 50 calls without a split, whether its
# first two calls ran the same GPU head count, and the CPU side's factor at calls 1, 2, 3 over
# the class's steady factor at that head count (median over the 10th call on of runs of splits).
import gzip, re, sys
from collections import defaultdict
def med(a): a = sorted(a); return a[len(a) // 2] if a else float('nan')
tot_same = tot = 0; r1 = []; r2 = []; r3 = []
for f in sys.argv[1:]:
    classes = defaultdict(list); pend = {}
    for line in gzip.open(f, 'rt'):
        if not line.startswith('[auto] ('): continue
        key = line[7:line.index(')') + 1]
        m = re.search(r'-> (\w+) \((\w+) by [\d.]+, (\d+) gpu heads', line)
        if m: pend[key] = int(m.group(3)); continue
        m = re.search(r' ran (\w+): ([\d.]+) ms', line)
        if not m: continue
        s = re.search(r'sides cpu [\d.]+ ms = ([\d.]+) x', line)
        classes[key].append((m.group(1), pend.get(key, -1), s and float(s.group(1))))
    for key, calls in classes.items():
        prev, pos, last, steady, runs = None, 0, None, defaultdict(list), []
        for i, (k, h, x) in enumerate(calls):
            pos = pos + 1 if k == prev else 1; prev = k
            if k != 'Split': continue
            if pos >= 10 and x: steady[h].append(x)
            if pos == 1: runs.append((i - last - 1 if last is not None else -1, []))
            if pos <= 3: runs[-1][1].append((h, x))
            last = i
        st = {h: med(v) for h, v in steady.items() if len(v) >= 5}
        for gap, cs in runs:
            if gap <= 50 or len(cs) < 2: continue
            tot += 1; tot_same += cs[0][0] == cs[1][0]
            for j, acc in enumerate((r1, r2, r3)):
                if j < len(cs) and cs[j][1] and cs[j][0] in st: acc.append(cs[j][1] / st[cs[j][0]])
print(f'{tot} re-checks after > 50 calls without a split; same GPU head count in calls 1 and 2: {tot_same}')
for n, a in (('1st', r1), ('2nd', r2), ('3rd', r3)):
    a = sorted(a)
    if a: print(f'{n} call: CPU side factor / steady: n {len(a)}, median {med(a):.2f}, p10 {a[len(a)//10]:.2f}, p90 {a[9*len(a)//10]:.2f}')
