#!/bin/bash
# noisy.sh SCRIPT N [args]: runs .hybin/SCRIPT N ARGS beside a noisy neighbour: phases of
# 1-3 s with NMIN..NMIN+NSPAN-1 (default 4-15) busy processes, then 1-3 s quiet (seeded; the neighbour's log to $OUT).
S=$1; shift
( RANDOM=${SEED:-7}; while :; do n=$((RANDOM%${NSPAN:-12}+${NMIN:-4})); d=$((RANDOM%3+1)); q=$((RANDOM%3+1));
  echo "$(date +%s.%N) busy $n ${d}s quiet ${q}s"
  for i in $(seq $n); do timeout $d sh -c 'while :; do :; done' & done; wait; sleep $q; done ) > $OUT/noise_$1.log 2>&1 &
H=$!
bash .hybin/$S "$@"
kill $H; pkill -f "while :; do :; done"; true
