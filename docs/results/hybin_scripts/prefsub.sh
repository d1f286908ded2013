#!/bin/bash
# prefsub.sh N: a build with temporary sub-phase timers in the Vulkan prefill's decisions
# (TMP lines: gate validation or the check of given decisions, allocation, the per-slab loop);
# bench prefill 1k with the vulkan backend alone, then auto alone; medians of each.
N=$1
source .hybin/setup.sh
med() { sort -n | awk '{a[NR]=$1} END {printf "%.1f", a[int((NR+1)/2)]}'; }
for b in vulkan auto; do
  FOXEDGE_VULKAN_PROFILE=1 timeout 100 .hybin/foxedge bench --backend $b --ops prefill --lengths 1k --budget-s 2 > $OUT/sub${N}_$b.txt 2> $OUT/sub${N}_${b}_stderr.txt
  grep TMP $OUT/sub${N}_${b}_stderr.txt > /tmp/t.txt; n=$(wc -l < /tmp/t.txt); h=$((n/2))
  for part in first last; do
    if [ $part = first ]; then head -n $h /tmp/t.txt > /tmp/u.txt; else tail -n $h /tmp/t.txt > /tmp/u.txt; fi
    echo "# $b $part half ($h calls): pre $(awk '{print $3}' /tmp/u.txt | med) alloc $(awk '{print $5}' /tmp/u.txt | med) loop $(awk '{print $7}' /tmp/u.txt | med) us (medians)"
  done
  gzip $OUT/sub${N}_${b}_stderr.txt
done
