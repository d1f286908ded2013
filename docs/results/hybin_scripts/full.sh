#!/bin/bash
# full.sh N [bench args]: foxedge bench --full --control ARGS, table/json/stderr into $OUT.
N=$1; shift
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
nproc; grep -m1 "model name" /proc/cpuinfo
timeout ${T:-540} ${BIN:-.hybin/foxedge} bench --full --control "$@" --out $OUT/run$N.json > $OUT/run${N}_table.txt 2> >(gzip > $OUT/run${N}_stderr.txt.gz)
echo "rc $?"
sleep 1
grep "^|\|^#" $OUT/run${N}_table.txt
