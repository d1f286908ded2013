#!/bin/bash
# split2.sh N: two rounds of (prefill 1k,4k; decode 1k,4k) full.sh cells at budget 2 s.
N=$1
mkdir -p /tmp/res
export OUT_REAL=$OUT
for i in 0 2; do
OUT=/tmp/res T=200 bash .hybin/full.sh $((N+i)) --ops prefill --lengths 1k,4k --budget-s 2 | grep "^| \(prefill\|decode\)\|^# calib"
OUT=/tmp/res T=200 bash .hybin/full.sh $((N+i+1)) --ops decode --lengths 1k,4k --budget-s 2 | grep "^| \(prefill\|decode\)"
done
cd /tmp/res && tar czf $OUT_REAL/res.tgz . && ls -la $OUT_REAL
