#!/bin/bash
# jobs.sh N JOB...: each JOB = BIN:OPS:LENGTHS[:trace] (BIN: c = .hybin/foxedge, p = .hybin/prev, m = .hybin/main),
# a full.sh cell set (budget 2 s) per job, run numbers N, N+1, ...; a ":trace" job runs traced (budget 1 s, cpu,vulkan,hybrid,auto).
N=$1; shift
source .hybin/setup.sh
for x in main prev; do [ -f .hybin/$x.xz ] && [ ! -x .hybin/$x ] && xz -dc .hybin/$x.xz > .hybin/$x && chmod +x .hybin/$x; done
mkdir -p /tmp/res
export OUT_REAL=$OUT
i=$N
for j in "$@"; do
  IFS=: read b ops lens tr <<< "$j"
  case $b in c) BIN=.hybin/foxedge;; p) BIN=.hybin/prev;; m) BIN=.hybin/main;; esac
  echo "== $i $j"
  if [ "$tr" = trace ]; then
    FOXEDGE_TRACE_AUTO=1 timeout 150 $BIN bench --backend cpu,vulkan,hybrid,auto --ops $ops --lengths $lens --budget-s 1 > /tmp/res/tr$i.txt 2> /tmp/res/tr$i.err
    grep "^| [pd]" /tmp/res/tr$i.txt; gzip -f /tmp/res/tr$i.err
  else
    BIN=$BIN OUT=/tmp/res T=${T:-200} bash .hybin/full.sh $i --ops $ops --lengths $lens --budget-s 2 | grep "^| \(prefill\|decode\)\|^# calib"
  fi
  echo "$i $j" >> /tmp/res/order.txt
  i=$((i+1))
done
cd /tmp/res && tar czf $OUT_REAL/res.tgz . && ls -la $OUT_REAL
