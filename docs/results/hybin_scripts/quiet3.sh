#!/bin/bash
# quiet3.sh N: three quiet decode 1k runs of the current binary: all engines (--control), only
# cpu/auto (+ the controls), all engines with FOXEDGE_VULKAN_SPIN_US=0; the table lines last.
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
nproc; grep -m1 "model name" /proc/cpuinfo
B=.hybin/foxedge
timeout 150 $B bench --full --control --ops decode --lengths 1k --out $OUT/run$N.json > $OUT/run${N}_table.txt 2>/dev/null
timeout 150 $B bench --full --control --backend cpu,auto --ops decode --lengths 1k --out $OUT/run$((N+1)).json > $OUT/run$((N+1))_table.txt 2>/dev/null
FOXEDGE_VULKAN_SPIN_US=0 timeout 150 $B bench --full --control --ops decode --lengths 1k --out $OUT/run$((N+2)).json > $OUT/run$((N+2))_table.txt 2>/dev/null
for i in 0 1 2; do echo "# run $((N+i))"; grep -o "CPU share.*" $OUT/run$((N+i))_table.txt; grep "^decode" $OUT/run$((N+i))_table.txt | grep -v "vulkan\|hybrid"; grep "^| decode" $OUT/run$((N+i))_table.txt; done
