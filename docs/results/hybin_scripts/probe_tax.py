#!/usr/bin/env python3
# probe_tax.py TRACE.err.gz: per auto class, the time of calls off the locally dominant plan
# (the most frequent within +-50 calls), and of its first 5 calls after them, beyond its steady
# median there (its calls 6+ into a run), as a share of the class's time.
import gzip, re, sys
from collections import Counter
def med(a): a = sorted(a); return a[len(a) // 2]
classes = {}
for line in gzip.open(sys.argv[1], 'rt'):
    if not line.startswith('[auto] ('): continue
    m = re.search(r' ran (\w+): ([\d.]+) ms', line)
    if m: classes.setdefault(line[7:line.index(')') + 1], []).append((m.group(1), float(m.group(2))))
for key, calls in classes.items():
    n, tot, tax = len(calls), sum(t for _, t in calls), Counter()
    for i, (k, t) in enumerate(calls):
        lo, hi = max(0, i - 50), min(n, i + 51)
        dom = Counter(kk for kk, _ in calls[lo:hi]).most_common(1)[0][0]
        ref = [tt for j, (kk, tt) in enumerate(calls[lo:hi], lo)
               if kk == dom and all(calls[j - q][0] == dom for q in range(1, 6) if j - q >= 0)]
        if len(ref) < 5: continue
        after = k == dom and any(calls[i - q][0] != dom for q in range(1, 6) if i - q >= 0)
        if k != dom or after:
            tax[('probe:' if k != dom else 'after:') + k] += t - med(ref)
    print(key, 'calls', n, 'tax %.1f%%' % (100 * sum(tax.values()) / tot),
          {k: '%.1f%%' % (100 * v / tot) for k, v in tax.items()})
