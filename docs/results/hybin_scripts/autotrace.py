# autotrace.py: the calls of a FOXEDGE_TRACE_AUTO trace (stderr, gzipped), per auto class.
import gzip, re
from collections import defaultdict

def med(a):
    a = sorted(a)
    return a[len(a) // 2] if a else float('nan')

def calls(path):
    """{class: [(kind, ms, gpu heads, (cpu ms, cpu x, gpu ms, gpu x) or None)]}, in call order."""
    classes, heads = defaultdict(list), {}
    for line in gzip.open(path, 'rt'):
        if not line.startswith('[auto] ('):
            continue
        key = line[7:line.index(')') + 1]
        m = re.search(r'-> (\w+) \((\w+) by [\d.]+, (\d+) gpu heads', line)
        if m:
            heads[key] = int(m.group(3))
            continue
        m = re.search(r' ran (\w+): ([\d.]+) ms', line)
        if not m:
            continue
        s = re.search(r'sides cpu ([\d.]+) ms = ([\d.]+) x, gpu ([\d.]+) ms = ([\d.]+) x', line)
        sides = tuple(float(s.group(i)) for i in (1, 2, 3, 4)) if s else None
        classes[key].append((m.group(1), float(m.group(2)), heads.get(key, -1), sides))
    return classes

def positions(cs):
    """Each call's place in its run of calls of one kind (1 = the first after a switch)."""
    out, prev, pos = [], None, 0
    for c in cs:
        pos = pos + 1 if c[0] == prev else 1
        prev = c[0]
        out.append(pos)
    return out
