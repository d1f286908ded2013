#!/bin/bash
# ab.sh N ORDER: for each binary of ORDER (b = branch .hybin/foxedge, m = main .hybin/main), prefill 1k,4k then decode 1k,4k
# (full.sh cells, budget 2 s); run numbers N, N+1, N+2, ... in that order; tables into $OUT/res.tgz.
N=$1; ORDER=$2
source .hybin/setup.sh
[ -f .hybin/main.xz ] && [ ! -x .hybin/main ] && xz -dc .hybin/main.xz > .hybin/main && chmod +x .hybin/main
mkdir -p /tmp/res
export OUT_REAL=$OUT
i=$N
for b in $ORDER; do
  case $b in b) BIN=.hybin/foxedge;; m) BIN=.hybin/main;; esac
  echo "== $b run $i / $((i+1))"
  BIN=$BIN OUT=/tmp/res T=${TP:-200} bash .hybin/full.sh $i --ops prefill --lengths 1k,4k --budget-s 2 | grep "^| \(prefill\|decode\)\|^# calib"
  BIN=$BIN OUT=/tmp/res T=${TD:-170} bash .hybin/full.sh $((i+1)) --ops decode --lengths 1k,4k --budget-s 2 | grep "^| \(prefill\|decode\)"
  echo "$b $i $((i+1))" >> /tmp/res/order.txt
  i=$((i+2))
done
cd /tmp/res && tar czf $OUT_REAL/res.tgz . && ls -la $OUT_REAL
