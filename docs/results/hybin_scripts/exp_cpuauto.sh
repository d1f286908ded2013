#!/bin/bash
# exp_cpuauto.sh N0: alternating runs of decode 1k,4k: A = --backend cpu,auto --control, B = the usual four
# backends --control; prints the decode rows of each.
N=$1; shift
for r in A B A B; do
  if [ $r = A ]; then set -- --backend cpu,auto; else set --; fi
  T=150 bash .hybin/full.sh $N --ops decode --lengths 1k,4k --budget-s 3 "$@" > /dev/null 2>&1
  echo "# run $N $r"; grep "^| decode\|^# control" $OUT/run${N}_table.txt
  N=$((N+1))
done
