#!/bin/bash
# estab.sh N0 PAIRS [PROF]: one binary, old = FOXEDGE_TMP_EXACT_PLAN=1 FOXEDGE_TMP_NO_OVERLAP=1
# (auto hands its exact boundary; the Vulkan prefill decides, then packs), new = neither.
# PROF=1: FOXEDGE_VULKAN_PROFILE benches per variant and backend (vulkan, auto), prefill
# 1k,4k,16k, median phases; then PAIRS ABBA pairs of quiet prefill 1k,4k runs; one tgz back.
N=$1; P=${2:-2}; PROF=${3:-1}
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
med() { sort -n | awk '{a[NR]=$1} END {printf "%.3f", a[int((NR+1)/2)]}'; }
envof() { if [ $1 = old ]; then echo "FOXEDGE_TMP_EXACT_PLAN=1 FOXEDGE_TMP_NO_OVERLAP=1"; else echo "FOXEDGE_TMP_NONE=1"; fi; }
mkdir -p /tmp/res
if [ $PROF = 1 ]; then
for b in old new; do for be in vulkan auto; do
  f=/tmp/res/prof${N}_${b}_$be
  env $(envof $b) FOXEDGE_VULKAN_PROFILE=1 timeout 150 .hybin/foxedge bench --backend $be --ops prefill --lengths 1k,4k,16k --budget-s 1 > $f.txt 2> $f.err
  for L in 1024 4096 16384; do
    grep "prefill 1x16x${L}x64" $f.err | sed 's/.*: decisions //; s/ ms;.*//' > /tmp/ph.txt
    echo "PROF $b $be L=$L n=$(wc -l < /tmp/ph.txt) decisions $(awk '{print $1}' /tmp/ph.txt | med) setup $(awk '{print $3}' /tmp/ph.txt | med) pack $(awk '{print $5}' /tmp/ph.txt | med) upload $(awk '{print $7}' /tmp/ph.txt | med) kernel $(awk '{print $9}' /tmp/ph.txt | med) ms"
  done
  grep -E "^prefill .* $be " $f.txt | sed "s/^/PROFROW $b $be /"
done; done
fi
for p in $(seq 1 $P); do
  if [ $((p % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for b in $order; do
    env $(envof $b) T=110 OUT=/tmp/res bash .hybin/full.sh $N --ops prefill --lengths 1k,4k --budget-s 3 > /dev/null 2>&1
    echo "# run $N $b"; grep "^| prefill" /tmp/res/run${N}_table.txt
    N=$((N+1))
  done
done
cd /tmp/res && gzip -f prof*.err 2>/dev/null; tar czf $OUT/res.tgz . && ls -la $OUT
