#!/bin/bash
# splitvar2.sh N: traced+profiled prefill 1k,4k (cpu,vulkan,hybrid,auto), then full.sh prefill 1k,4k.
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
f=/tmp/res/var${N}
FOXEDGE_TRACE_AUTO=1 FOXEDGE_VULKAN_PROFILE=1 timeout 150 .hybin/foxedge bench --backend cpu,vulkan,hybrid,auto --ops prefill --lengths 1k,4k --budget-s 1 > $f.txt 2> $f.err
grep -E "^\| prefill" $f.txt
grep "prefill split" $f.err | awk '{split($4,h,"+"); k=h[1]"+"h[2]; c[k]+=$8; g[k]+=$12; u[k]+=$14; n[k]++} END {for (k in n) if (n[k]>4) printf "split %s n=%d cpu %.3f gpu %.3f + %.3f (means)\n", k, n[k], c[k]/n[k], g[k]/n[k], u[k]/n[k]}'
grep "foxedge-vulkan prefill" $f.err | awk '{k=$3; for(i=1;i<=NF;i++) if ($i ~ /^(decisions|setup|pack|upload|kernel|download|unpack)$/) {s[k,$i]+=$(i+1)}; n[k]++} END {for (kk in n) if (n[kk]>4) {printf "%s n=%d", kk, n[kk]; split("decisions setup pack upload kernel download unpack",a," "); for (j=1;j<=7;j++) printf " %s %.3f", a[j], s[kk,a[j]]/n[kk]; print ""}}'
OUT=/tmp/res T=200 bash .hybin/full.sh $((N+1)) --ops prefill --lengths 1k,4k --budget-s 2 | grep -v "^#" 
cd /tmp/res && gzip -f *.err; tar czf $OUT/res.tgz . && ls -la $OUT
