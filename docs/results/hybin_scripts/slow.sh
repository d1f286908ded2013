#!/bin/bash
# slow.sh N: quiet decode 1k,4k with FOXEDGE_BENCH_SLOW_MS=20 (run N), then the same at 1k traced
# (trace N+1); the slow-call lines printed last.
N=$1
FOXEDGE_BENCH_SLOW_MS=20 T=200 bash .hybin/full.sh $N --ops decode --lengths 1k,4k > /dev/null 2>&1
grep "^| decode\|^# by total" $OUT/run${N}_table.txt
zcat $OUT/run${N}_stderr.txt.gz | grep -E "slow call|^\[bench\] decode L" | head -60
M=$((N+1))
FOXEDGE_BENCH_SLOW_MS=20 T=150 bash .hybin/trace.sh $M --ops decode --lengths 1k > /dev/null 2>&1
zcat $OUT/trace${M}_stderr.txt.gz | grep -n -B3 -A2 "slow call" | grep -v "^--$" | head -60 | cut -c1-220
cd $OUT && tar czf out.tgz run* trace* && rm -f run*.json run*_table.txt run*_stderr.txt.gz trace*.json trace*_table.txt trace*_stderr.txt.gz
