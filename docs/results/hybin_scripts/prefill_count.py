#!/usr/bin/env python3
# prefill_count.py TRACE.err.gz: per prefill class of a FOXEDGE_TRACE_AUTO trace, the
# "work counted in N us" of its CPU and split picks (the count before the call; a GPU pick
# started ahead counts beside the GPU and reads 0): n, median, 10th and 90th percentiles.
import gzip, re, sys
from collections import defaultdict
d = defaultdict(lambda: defaultdict(list))
for line in gzip.open(sys.argv[1], 'rt'):
    m = re.match(r'\[auto\] (\(false, \d+, \d+\)) (.*)', line)
    if not m: continue
    a = re.search(r'-> (\w+) .*work counted in (\d+) us', m.group(2))
    if a: d[m.group(1)][a.group(1)].append(int(a.group(2)))
for k in sorted(d):
    print(k, '  '.join('%s n%d median %d p10 %d p90 %d' % (n, len(v), sorted(v)[len(v) // 2],
          sorted(v)[len(v) // 10], sorted(v)[9 * len(v) // 10]) for n, v in sorted(d[k].items())
          if n != 'Gpu'))
