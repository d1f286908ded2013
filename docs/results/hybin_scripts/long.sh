#!/bin/bash
# long.sh N WHICH: decode then prefill at 16k,64k (full.sh cells, budget 2 s) of one binary (b: .hybin/foxedge, m: .hybin/main).
N=$1
source .hybin/setup.sh
[ -f .hybin/main.xz ] && [ ! -x .hybin/main ] && xz -dc .hybin/main.xz > .hybin/main && chmod +x .hybin/main
case $2 in b) BIN=.hybin/foxedge;; m) BIN=.hybin/main;; esac
mkdir -p /tmp/res
export OUT_REAL=$OUT
BIN=$BIN OUT=/tmp/res T=${TD:-250} bash .hybin/full.sh $N --ops decode --lengths 16k,64k --budget-s 2 | grep "^| \(prefill\|decode\)\|^# calib\|^rc"
BIN=$BIN OUT=/tmp/res T=${TP:-300} bash .hybin/full.sh $((N+1)) --ops prefill --lengths 16k,64k --budget-s 2 | grep "^| \(prefill\|decode\)\|^rc"
cd /tmp/res && tar czf $OUT_REAL/res.tgz . && ls -la $OUT_REAL
