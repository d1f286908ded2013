#!/bin/bash
# splitvar.sh N: hybrid split variants (FOXEDGE_TMP_SPLIT_*), traced and profiled, prefill 1k,4k.
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
for v in scope global join; do
  f=/tmp/res/var${N}_$v
  case $v in scope) E=FOXEDGE_TMP_NONE=1;; global) E=FOXEDGE_TMP_SPLIT_GLOBAL=1;; join) E=FOXEDGE_TMP_SPLIT_JOIN=1;; esac
  env $E FOXEDGE_TRACE_AUTO=1 FOXEDGE_VULKAN_PROFILE=1 timeout 150 .hybin/foxedge bench --backend cpu,vulkan,hybrid,auto --ops prefill --lengths 1k,4k --budget-s 1 > $f.txt 2> $f.err
  grep -E "^\| prefill" $f.txt | sed "s/^/$v /"
  grep "prefill split" $f.err | awk -v v=$v '{split($4,h,"+"); k=h[1]"+"h[2]; c[k]+=$8; g[k]+=$12; u[k]+=$14; n[k]++} END {for (k in n) printf "%s split %s n=%d cpu %.3f gpu %.3f + %.3f (means)\n", v, k, n[k], c[k]/n[k], g[k]/n[k], u[k]/n[k]}'
done
cd /tmp/res && gzip -f *.err; tar czf $OUT/res.tgz . && ls -la $OUT
