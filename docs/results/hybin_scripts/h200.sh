#!/bin/bash
# One H200 call: the CLI grid (prefill, then decode; no control engines), then criterion at 1k/4k.
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
xz -dc .hybin/backends.xz > .hybin/backends && chmod +x .hybin/backends
R=/tmp/res; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo; free -g | head -2; date -u; } > $R/machine.txt 2>&1
cat $R/machine.txt
for op in prefill decode; do
  S=$SECONDS
  timeout ${T1:-190} .hybin/foxedge bench --full --ops $op --budget-s 2 --out $R/h200_$op.json --plot $R/plots_$op > $R/h200_$op.txt 2> >(gzip > $R/h200_${op}_err.gz)
  echo "$op rc $? in $((SECONDS-S)) s"
done
S=$SECONDS
FOXEDGE_BENCH_LENGTHS=1k,4k timeout ${T2:-150} .hybin/backends --bench --noplot > $R/criterion.txt 2>&1
echo "criterion rc $? in $((SECONDS-S)) s"
mkdir -p $OUT/plots
cp $R/plots_prefill/*.png $OUT/plots/ 2>/dev/null; cp $R/plots_decode/decode_throughput.png $OUT/plots/ 2>/dev/null
(cd $R && tar czf $OUT/res.tgz .)
grep "^|\|^#" $R/h200_prefill.txt $R/h200_decode.txt | cut -c1-400
grep -E "^(prefill|decode)/|time:" $R/criterion.txt | paste - - | awk '{print $1, $3, $4, $5, $6, $7, $8}'
