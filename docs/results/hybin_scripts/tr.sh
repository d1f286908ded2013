#!/bin/bash
# tr.sh N: traced prefill 1k,4k of .hybin/foxedge (auto only + vulkan + hybrid), then ab.sh N+1 "b m".
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
FOXEDGE_TRACE_AUTO=1 timeout 150 .hybin/foxedge bench --backend cpu,vulkan,hybrid,auto --ops prefill --lengths 1k,4k --budget-s 1 > /tmp/res/tr${N}.txt 2> /tmp/res/tr${N}.err
grep "^| prefill" /tmp/res/tr${N}.txt
grep "ran Split" /tmp/res/tr${N}.err | awk '{print $2,$3,$4}' | sort | uniq -c
gzip -f /tmp/res/tr${N}.err
TP=150 TD=110 bash .hybin/ab.sh $((N+1)) "${ORDER:-b m}"
