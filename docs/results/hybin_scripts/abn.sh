#!/bin/bash
# abn.sh N0 SECONDS [bench args]: pairs of full.sh runs beside the noisy neighbour, the old
# binary (.hybin/foxedge_old.xz) and the new one (.hybin/foxedge) alternating first, seeds
# 11, 12, ...; run numbers N0, N0+1, ...; no new pair after SECONDS.
N=$1; LIM=$2; shift 2
xz -dc .hybin/foxedge_old.xz > /tmp/foxedge_old; chmod +x /tmp/foxedge_old
start=$(date +%s); s=${SEED0:-11}; i=0
while [ $(( $(date +%s) - start )) -lt $LIM ]; do
  if [ $((i%2)) = 0 ]; then order="old new"; else order="new old"; fi
  for b in $order; do
    if [ $b = old ]; then bin=/tmp/foxedge_old; else bin=.hybin/foxedge; fi
    t0=$(date +%s)
    SEED=$s BIN=$bin T=${T:-150} bash .hybin/noisy.sh full.sh $N "$@" > /dev/null 2>&1
    echo "# run $N $b seed $s ($(( $(date +%s) - t0 )) s)" | tee -a $OUT/abn.txt
    grep "^| decode" $OUT/run${N}_table.txt | tee -a $OUT/abn.txt
    N=$((N+1))
  done
  s=$((s+1)); i=$((i+1))
done
cd $OUT && tar czf runs.tgz run* noise_* && rm -f run*.json run*_stderr.txt.gz run*_table.txt noise_*
