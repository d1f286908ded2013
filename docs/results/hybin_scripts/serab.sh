#!/bin/bash
# serab.sh N R: auto's own time at prefill ACP 1k/4k with the facade's serial-decision limit at
# its default (2^16) and at 2^14 (FOXEDGE_TMP_SERIAL_MAX), R alternating rounds of
# `bench --backend vulkan,auto`; then one traced bench each; one tgz back.
N=$1; R=${2:-2}
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
for r in $(seq 1 $R); do
  if [ $((r % 2)) = 1 ]; then order="65536 16384"; else order="16384 65536"; fi
  for m in $order; do
    FOXEDGE_TMP_SERIAL_MAX=$m timeout 150 .hybin/foxedge bench --backend vulkan,auto --ops prefill --lengths 1k,4k --budget-s 2 --out /tmp/res/s${N}_${m}_$r.json > /tmp/res/s${N}_${m}_$r.txt 2>/dev/null
    echo "# max $m round $r"; grep -E "^(prefill|\| prefill)" /tmp/res/s${N}_${m}_$r.txt
  done
done
for m in 65536 16384; do
  FOXEDGE_TRACE_AUTO=1 FOXEDGE_TMP_SERIAL_MAX=$m timeout 150 .hybin/foxedge bench --backend auto --ops prefill --lengths 1k,4k --budget-s 1 > /tmp/res/t${N}_$m.txt 2> /tmp/res/t${N}_$m.err
done
cd /tmp/res && gzip -f *.err; tar czf $OUT/res.tgz . && ls $OUT
