import re,sys,statistics as st
lines=open(sys.argv[1]).read().splitlines()
d={};cur=[]
for l in lines:
    if l.startswith('[bench] decode') and ' vulkan:' in l:
        d[l.split(':')[0][8:]]=cur; cur=[]; continue
    if l.startswith('foxedge-vulkan decode') and ' 16 rows sent' in l:
        cur.append([float(x) for x in re.findall(r'(\d+(?:\.\d+)?)',l.split('sent:')[1])])
names='prep checks dirty plan pack build s+w barriers submit wait read g_up g_kern g_read rt'.split()
print('cell n '+' '.join(names))
for k,rows in d.items():
    rows=[r for r in rows if len(r)==len(names)]
    cols=list(zip(*rows))
    print(k,len(rows),' '.join(f"{st.median(c):.0f}" for c in cols))
