#!/bin/bash
# splitrun.sh N: prefill 1k,4k then decode 1k,4k (full.sh cells, budget 2 s), tables into $OUT/res.tgz.
N=$1
mkdir -p /tmp/res
export OUT_REAL=$OUT
OUT=/tmp/res T=230 bash .hybin/full.sh $N --ops prefill --lengths 1k,4k --budget-s 2
OUT=/tmp/res T=200 bash .hybin/full.sh $((N+1)) --ops decode --lengths 1k,4k --budget-s 2
cd /tmp/res && tar czf $OUT_REAL/res.tgz . && ls -la $OUT_REAL
