#!/bin/bash
# prefill_ab.sh N0: trace N0 (new binary, prefill 1k, quiet), then runs N0+1.. alternating
# old (.hybin/foxedge_old.xz) / new, prefill 1k,4k, quiet; prints the prefill rows.
N=$1; shift
source .hybin/setup.sh
xz -dc .hybin/foxedge_old.xz > /tmp/foxedge_old; chmod +x /tmp/foxedge_old
T=150 bash .hybin/trace.sh $N --ops prefill --lengths 1k --budget-s 3 > /dev/null 2>&1
echo "# trace $N new"; grep "^| prefill" $OUT/trace${N}_table.txt
N=$((N+1))
for b in old new new old; do
  if [ $b = old ]; then bin=/tmp/foxedge_old; else bin=.hybin/foxedge; fi
  BIN=$bin T=150 bash .hybin/full.sh $N --ops prefill --lengths 1k,4k --budget-s 3 > /dev/null 2>&1
  echo "# run $N $b"; grep "^| prefill" $OUT/run${N}_table.txt
  N=$((N+1))
done
cd $OUT && tar czf runs.tgz run* && rm -f run*.json run*_stderr.txt.gz run*_table.txt
