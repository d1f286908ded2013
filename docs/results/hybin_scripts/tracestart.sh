#!/bin/bash
# tracestart.sh N0 RUNS [bench args]: RUNS trace.sh runs of the new binary, each with NS
# (default 20) processes spinning for its first SS (default 25) seconds; prints the
# re-measure trace lines and the decode rows.
N=$1; R=$2; shift 2
source .hybin/setup.sh
for i in $(seq $R); do
  for j in $(seq ${NS:-20}); do timeout ${SS:-25} sh -c 'while :; do :; done' & done
  T=${T:-200} bash .hybin/trace.sh $N "$@" > /dev/null 2>&1
  echo "# trace $N"
  zcat $OUT/trace${N}_stderr.txt.gz | grep "re-measure\|calibration:" | cut -c1-220
  grep "^| decode\|^| prefill\|after the last" $OUT/trace${N}_table.txt | cut -c1-400
  N=$((N+1))
done
