#!/bin/bash
# scratchab.sh N: old = FOXEDGE_TMP_NO_SCRATCH=1 (fresh decision buffers each call), new = reused; ABBA;
# variant (old = FOXEDGE_TMP_NO_SCRATCH=1, new); median phases per cell (lines before each
# "[bench] prefill L=... <backend>: median" line).
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
for v in old new new old; do for be in vulkan; do
  f=/tmp/res/prof${N}_${v}_${be}_$RANDOM
  if [ $v = old ]; then E=FOXEDGE_TMP_NO_SCRATCH=1; else E=FOXEDGE_TMP_NONE=1; fi
  env $E FOXEDGE_VULKAN_PROFILE=1 timeout 100 .hybin/foxedge bench --backend $be --ops prefill --lengths 1k,4k --budget-s 1 > $f.txt 2> $f.err
  awk -v tag="$v $be" '
    /foxedge-vulkan prefill/ { sub(/.*: decisions /,""); sub(/ ms;.*/,""); n++; for (c=1;c<=13;c+=2) v[c,n]=$c; next }
    /^\[bench\] prefill L=/ { cell=$3" "$4; 
      printf "PROF %s %s n=%d", tag, cell, n;
      split("dec setup pack up kern down unpack", nm, " ");
      for (c=1;c<=13;c+=2) { m=0; for (i=1;i<=n;i++) a[i]=v[c,i]; 
        for (i=2;i<=n;i++){x=a[i];j=i-1;while(j>0&&a[j]>x){a[j+1]=a[j];j--}a[j+1]=x}
        printf " %s %s", nm[(c+1)/2], a[int((n+1)/2)] }
      print ""; n=0 }' $f.err
  grep -E "^prefill " $f.txt | sed "s/^/ROW $v $be /"
done; done
cd /tmp/res && gzip -f *.err 2>/dev/null; tar czf $OUT/res.tgz . && ls -la $OUT
