#!/bin/bash
# prefprof.sh N: FOXEDGE_VULKAN_PROFILE=1 bench prefill 1k (dense, then ACP), vulkan alone then
# auto alone (quiet); prints the table rows and, per engine, the median host phases of the
# first and last third of its prefill calls (dense cell, ACP cell).
N=$1
source .hybin/setup.sh
med() { sort -n | awk '{a[NR]=$1} END {printf "%.3f", a[int((NR+1)/2)]}'; }
for b in vulkan auto; do
  FOXEDGE_VULKAN_PROFILE=1 timeout 150 .hybin/foxedge bench --backend $b --ops prefill --lengths 1k --budget-s 2 > $OUT/prof${N}_$b.txt 2> $OUT/prof${N}_${b}_stderr.txt
  echo "# $b"; grep "^| prefill" $OUT/prof${N}_$b.txt
  grep "foxedge-vulkan prefill 1x16x1024" $OUT/prof${N}_${b}_stderr.txt | sed 's/.*: decisions //; s/ ms;.*//' > /tmp/ph.txt
  n=$(wc -l < /tmp/ph.txt); t=$((n/3))
  for part in first last; do
    if [ $part = first ]; then head -n $t /tmp/ph.txt > /tmp/pp.txt; else tail -n $t /tmp/ph.txt > /tmp/pp.txt; fi
    echo "  $part third ($t calls): decisions $(awk '{print $1}' /tmp/pp.txt | med) setup $(awk '{print $3}' /tmp/pp.txt | med) pack $(awk '{print $5}' /tmp/pp.txt | med) upload $(awk '{print $7}' /tmp/pp.txt | med) kernel $(awk '{print $9}' /tmp/pp.txt | med) ms (medians)"
  done
  gzip $OUT/prof${N}_${b}_stderr.txt
done
