# mean_median_ratios.py run1.json ...: per decode cell of `foxedge bench --out` reports, auto/best
# by the median of the batch samples (as bench reports it) and by their mean (total time).
import json,sys,statistics as st,glob,re
for f in sys.argv[1:]:
    d=json.load(open(f))
    out=[]
    for L in sorted(set(c['len'] for c in d['cells'] if c['op']=='decode')):
      for acp in (False,True):
        cs={c['backend']:c['samples'] for c in d['cells'] if c['len']==L and c['acp']==acp and c['op']=='decode'}
        if 'auto' not in cs: continue
        m={b:sum(v)/len(v) for b,v in cs.items()}
        md={b:st.median(v) for b,v in cs.items()}
        out.append('%s%s med %.3f mean %.3f'%('A' if acp else 'D',L//1024,min(md[b] for b in ('cpu','vulkan','hybrid') if b in md)/md['auto'],min(m[b] for b in ('cpu','vulkan','hybrid') if b in m)/m['auto']))
    print(f.split('/')[-1], ' | '.join(out))
