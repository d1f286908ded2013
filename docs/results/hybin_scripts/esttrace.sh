#!/bin/bash
# esttrace.sh N: FOXEDGE_TRACE_AUTO=1 bench --backend vulkan,auto, prefill 1k,4k, old then new env (as estab.sh).
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
envof() { if [ $1 = old ]; then echo "FOXEDGE_TMP_EXACT_PLAN=1 FOXEDGE_TMP_NO_OVERLAP=1"; else echo "FOXEDGE_TMP_NONE=1"; fi; }
mkdir -p /tmp/res
for b in old new old new; do
  f=/tmp/res/tr${N}_$b; [ -f $f.txt ] && f=${f}_2
  env $(envof $b) FOXEDGE_TRACE_AUTO=1 timeout 120 .hybin/foxedge bench --backend vulkan,auto --ops prefill --lengths 1k,4k --budget-s 2 > $f.txt 2> $f.err
  echo "# $b"; grep -E "^prefill" $f.txt
  for c in "(false, 14," "(false, 16,"; do
    grep -F "[auto] $c" $f.err | grep "ran Gpu" | sed 's/.*ran Gpu: \([0-9.]*\) ms.*(+\([0-9]*\) us choosing).*/\1 \2/' > /tmp/x.txt
    echo "$b class $c n=$(wc -l < /tmp/x.txt) gpu-ran med $(sort -n -k1 /tmp/x.txt | awk '{a[NR]=$1} END {print a[int(NR/2)+1]}') ms, choosing med $(sort -n -k2 /tmp/x.txt | awk '{a[NR]=$2} END {print a[int(NR/2)+1]}') us"
  done
done
cd /tmp/res && gzip -f *.err; tar czf $OUT/res.tgz . && ls $OUT
