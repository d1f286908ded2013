#!/bin/bash
# fuseab.sh N: vulkan/auto prefill 1k,4k,16k, fused (one submission) vs FOXEDGE_TMP_UNFUSED=1, ABBA; profiles.
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
i=0
for v in fused unfused unfused fused; do
  i=$((i+1)); f=/tmp/res/fuse${N}_${i}_$v
  if [ $v = unfused ]; then E=FOXEDGE_TMP_UNFUSED=1; else E=FOXEDGE_TMP_NONE=1; fi
  env $E FOXEDGE_VULKAN_PROFILE=1 timeout 120 .hybin/foxedge bench --backend vulkan,auto --ops prefill --lengths 1k,4k,16k --budget-s 2 > $f.txt 2> $f.err
  grep -E "^\| prefill" $f.txt | sed "s/^/$v /" | cut -c1-140
  grep "foxedge-vulkan prefill 1x16x" $f.err | awk -v v=$v '{k=$3; for(i=1;i<=NF;i++) if ($i ~ /^(pack|upload|kernel|download|unpack)$/) {s[k,$i]+=$(i+1)}; n[k]++} END {for (kk in n) if (n[kk]>4) {printf "%s %s n=%d", v, kk, n[kk]; split("pack upload kernel download unpack",a," "); for (j=1;j<=5;j++) printf " %s %.3f", a[j], s[kk,a[j]]/n[kk]; print ""}}'
done
cd /tmp/res && gzip -f *.err; tar czf $OUT/res.tgz . && ls -la $OUT
