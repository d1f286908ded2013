#!/bin/bash
# abstart.sh N0 SECONDS [bench args]: pairs of full.sh runs, old binary (.hybin/foxedge_old.xz)
# and new (.hybin/foxedge) alternating first, each with NS (default 20) processes spinning for
# the run's first SS (default 10) seconds (its calibration), then a quiet host; no new pair
# after SECONDS.
N=$1; LIM=$2; shift 2
source .hybin/setup.sh
xz -dc .hybin/foxedge_old.xz > /tmp/foxedge_old; chmod +x /tmp/foxedge_old
start=$(date +%s); i=0
while [ $(( $(date +%s) - start )) -lt $LIM ]; do
  if [ $((i%2)) = 0 ]; then order="old new"; else order="new old"; fi
  for b in $order; do
    if [ $b = old ]; then bin=/tmp/foxedge_old; else bin=.hybin/foxedge; fi
    t0=$(date +%s)
    for j in $(seq ${NS:-20}); do timeout ${SS:-10} sh -c 'while :; do :; done' & done
    BIN=$bin T=${T:-200} bash .hybin/full.sh $N "$@" > /dev/null 2>&1
    echo "# run $N $b ($(( $(date +%s) - t0 )) s) $(zcat $OUT/run${N}_stderr.txt.gz | grep -m1 'auto calibration' | grep -o 'decode cpu [^|]*')" | tee -a $OUT/abs.txt
    grep -o "CPU share.*" $OUT/run${N}_table.txt | sed 's/^/#   /' | tee -a $OUT/abs.txt
    grep -o "after the last cell.*decode cpu [^|]*" $OUT/run${N}_table.txt | grep -o "decode cpu.*" | sed 's/^/#   end: /' | tee -a $OUT/abs.txt
    grep "^| decode" $OUT/run${N}_table.txt | tee -a $OUT/abs.txt
    N=$((N+1))
  done
  i=$((i+1))
done
cd $OUT && tar czf runs.tgz run* && rm -f run*.json run*_stderr.txt.gz run*_table.txt
