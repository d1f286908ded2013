#!/bin/bash
# decab.sh N0 PAIRS [PROF]: (PROF=1) FOXEDGE_VULKAN_PROFILE benches, per binary (old, new) and
# backend (vulkan, auto), prefill 1k,4k,16k: median host phases per length; then PAIRS pairs of
# quiet prefill-1k runs N0.. alternating old/new (ABBA); prints the prefill rows; one tgz back.
N=$1; P=${2:-3}; PROF=${3:-1}
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
xz -dc .hybin/foxedge_old.xz > /tmp/foxedge_old; chmod +x /tmp/foxedge_old
med() { sort -n | awk '{a[NR]=$1} END {printf "%.3f", a[int((NR+1)/2)]}'; }
bin_of() { if [ $1 = old ]; then echo /tmp/foxedge_old; else echo .hybin/foxedge; fi; }
mkdir -p /tmp/res
if [ $PROF = 1 ]; then
for b in old new; do for be in vulkan auto; do
  f=/tmp/res/prof_${b}_$be
  FOXEDGE_VULKAN_PROFILE=1 timeout 120 $(bin_of $b) bench --backend $be --ops prefill --lengths 1k,4k,16k --budget-s 1 > $f.txt 2> $f.err
  for L in 1024 4096 16384; do
    grep "prefill 1x16x${L}x64" $f.err | sed 's/.*: decisions //; s/ ms;.*//' > /tmp/ph.txt
    echo "PROF $b $be L=$L n=$(wc -l < /tmp/ph.txt) decisions $(awk '{print $1}' /tmp/ph.txt | med) setup $(awk '{print $3}' /tmp/ph.txt | med) pack $(awk '{print $5}' /tmp/ph.txt | med) upload $(awk '{print $7}' /tmp/ph.txt | med) kernel $(awk '{print $9}' /tmp/ph.txt | med) ms"
  done
  grep "^| prefill" $f.txt | sed "s/^/PROFROW $b $be /"
done; done
fi
i=0
for p in $(seq 1 $P); do
  if [ $((p % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for b in $order; do
    BIN=$(bin_of $b) T=90 OUT=/tmp/res bash .hybin/full.sh $N --ops prefill --lengths 1k --budget-s 3 > /dev/null 2>&1
    echo "# run $N $b"; grep "^| prefill" /tmp/res/run${N}_table.txt
    N=$((N+1))
  done
done
cd /tmp/res && gzip -f prof_*.err 2>/dev/null; tar czf $OUT/res.tgz . && ls -la $OUT
