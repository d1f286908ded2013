#!/bin/bash
# aheadab.sh N0 PAIRS [TRACE]: one binary, old = FOXEDGE_TMP_NO_AHEAD=1 (every ACP prefill
# counted first), new = started on the GPU ahead of the count (see src/hybrid/ahead.rs). TRACE=1: a short traced auto
# bench of prefill 1k first. Then PAIRS ABBA pairs of quiet prefill 1k,4k runs; one tgz back.
N=$1; P=${2:-2}; TR=${3:-0}
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
envof() { if [ $1 = old ]; then echo "FOXEDGE_TMP_NO_AHEAD=1"; else echo "FOXEDGE_TMP_NONE=1"; fi; }
if [ $TR = 1 ]; then
  FOXEDGE_TRACE_AUTO=1 timeout 100 .hybin/foxedge bench --backend vulkan,auto --ops prefill --lengths 1k,4k --budget-s 0.5 > /tmp/res/tr${N}.txt 2> /tmp/res/tr${N}.err
  grep "^|" /tmp/res/tr${N}.txt
  echo "ahead lines: $(grep -c "ahead" /tmp/res/tr${N}.err); counted lines: $(grep -c 'raw ms' /tmp/res/tr${N}.err)"
  grep "ahead" /tmp/res/tr${N}.err | head -3
fi
for p in $(seq 1 $P); do
  if [ $((p % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for b in $order; do
    env $(envof $b) T=110 OUT=/tmp/res bash .hybin/full.sh $N --ops prefill --lengths 1k,4k --budget-s 3 > /dev/null 2>&1
    echo "# run $N $b"; grep "^| prefill" /tmp/res/run${N}_table.txt
    N=$((N+1))
  done
done
cd /tmp/res && gzip -f *.err 2>/dev/null; tar czf $OUT/res.tgz . && ls -la $OUT
