#!/usr/bin/env python3
# cold_sides.py TRACE.err.gz...: per auto class of a FOXEDGE_TRACE_AUTO trace, a split's CPU side
# over its GPU side (median) by its position in a run of splits (p1-p3; "steady" = 10th call on)
# and by the calls since the class's last split before the run (gap).
import gzip, re, sys
from collections import defaultdict
def med(a): a = sorted(a); return a[len(a) // 2] if a else float('nan')
for f in sys.argv[1:]:
    classes = defaultdict(list)
    for line in gzip.open(f, 'rt'):
        if not line.startswith('[auto] ('): continue
        key = line[7:line.index(')') + 1]
        m = re.search(r' ran (\w+): ([\d.]+) ms', line)
        if not m: continue
        s = re.search(r'sides cpu ([\d.]+) ms = [\d.]+ x, gpu ([\d.]+) ms', line)
        classes[key].append((m.group(1), float(s.group(1)) / float(s.group(2)) if s else None))
    for key, calls in classes.items():
        last, pos, prev, gap, b = None, 0, None, 0, defaultdict(list)
        for i, (k, r) in enumerate(calls):
            pos = pos + 1 if k == prev else 1; prev = k
            if k != 'Split': continue
            if pos == 1: gap = i - last - 1 if last is not None else 9999
            if pos <= 3 or pos >= 10:
                g = 'steady' if pos >= 10 else 'gap<=5' if gap <= 5 else 'gap6-50' if gap <= 50 else 'gap>50'
                b[(g, min(pos, 10))].append(r)
            last = i
        print(f.split('/')[-1], key, ' | '.join('%s p%d n%d %.2f' % (g, p, len(v), med(v)) for (g, p), v in sorted(b.items())))
