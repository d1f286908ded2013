#!/bin/bash
# tr4k.sh N K: K traced decode runs (LENS, default 4k) of .hybin/foxedge (cpu,vulkan,hybrid,auto; --full, budget 2 s), stderr kept.
N=$1; K=${2:-2}
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res; export OUT_REAL=$OUT
for i in $(seq $N $((N+K-1))); do
  FOXEDGE_TRACE_AUTO=${TRACE:-1} timeout ${T:-150} ${BIN:-.hybin/foxedge} bench --full --backend cpu,vulkan,hybrid,auto --ops decode --lengths ${LENS:-4k} --budget-s 2 --out /tmp/res/run$i.json > /tmp/res/tr$i.txt 2> /tmp/res/tr$i.err
  grep "^| [pd]\|^# calib" /tmp/res/tr$i.txt; gzip -f /tmp/res/tr$i.err
done
cd /tmp/res && tar czf $OUT_REAL/res.tgz . && ls -la $OUT_REAL
