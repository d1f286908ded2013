#!/bin/bash
# warm.sh: decode 1k --full with FOXEDGE_VULKAN_PROFILE=1 and FOXEDGE_BENCH_SLOW_MS=20; prints
# (with line numbers) the steps whose decode dirty-rows phase (the kernel's first compile in a
# context) or prefill setup took > 20 ms, the bench's cell lines, and the slow calls.
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
FOXEDGE_VULKAN_PROFILE=1 FOXEDGE_BENCH_SLOW_MS=20 timeout 250 ${BIN:-.hybin/foxedge} bench --full --control --ops decode --lengths 1k > $OUT/t.txt 2> $OUT/e.txt; echo rc $?
grep -n -E "calibration:|^\[bench\] decode L|slow call" $OUT/e.txt | cut -c1-120
grep -n "foxedge-vulkan" $OUT/e.txt | awk '{ if (match($0, /dirty rows [0-9]+/)) { v=substr($0,RSTART+11,RLENGTH-11)+0; if (v>20000) print substr($0,1,150) } if (match($0, /setup [0-9.]+/)) { v=substr($0,RSTART+6,RLENGTH-6)+0; if (v>20) print substr($0,1,150) } }'
grep "^| decode\|^# by total" $OUT/t.txt; gzip $OUT/e.txt
