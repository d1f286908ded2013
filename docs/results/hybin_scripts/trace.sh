#!/bin/bash
# trace.sh N [bench args]: FOXEDGE_TRACE_AUTO=1 foxedge bench --full --control ARGS; stderr gz.
N=$1; shift
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
FOXEDGE_TRACE_AUTO=1 timeout ${T:-400} .hybin/foxedge bench --full --control "$@" --out $OUT/trace$N.json > $OUT/trace${N}_table.txt 2> >(gzip > $OUT/trace${N}_stderr.txt.gz)
echo "rc $?"
sleep 2
grep "^|\|^#" $OUT/trace${N}_table.txt
