#!/bin/bash
# packab.sh N REPS: vulkan prefill (1k,4k,16k) and decode (1k,16k) with FOXEDGE_VULKAN_PROFILE,
# per variant of the temporary toggles: rows|tiles (FOXEDGE_TMP_PACK_ROWS) x wc|cached
# (FOXEDGE_TMP_UPLOAD_CACHED), REPS rounds in alternating order; median phases; one tgz back.
N=$1; R=${2:-2}
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
med() { sort -n | awk '{a[NR]=$1} END {printf "%.3f", a[int((NR+1)/2)]}'; }
mkdir -p /tmp/res
run() { # variant round
  v=$1; f=/tmp/res/p${N}_${v}_$2
  env_=""; case $v in rows_*) env_="$env_ FOXEDGE_TMP_PACK_ROWS=1";; esac
  case $v in *_cached) env_="$env_ FOXEDGE_TMP_UPLOAD_CACHED=1";; esac
  env $env_ FOXEDGE_VULKAN_PROFILE=1 timeout 150 .hybin/foxedge bench --backend vulkan --ops prefill,decode --lengths 1k,4k,16k --budget-s 1 > $f.txt 2> $f.err
}
for r in $(seq 1 $R); do
  if [ $((r % 2)) = 1 ]; then order="rows_wc tiles_wc tiles_cached rows_cached"; else order="rows_cached tiles_cached tiles_wc rows_wc"; fi
  for v in $order; do run $v $r; done
done
for v in rows_wc tiles_wc tiles_cached rows_cached; do
  for L in 1024 4096 16384; do
    cat /tmp/res/p${N}_${v}_*.err | grep "prefill 1x16x${L}x64" | sed 's/.*: decisions //; s/ ms;.*//' > /tmp/ph.txt
    echo "PROF $v L=$L n=$(wc -l < /tmp/ph.txt) decisions $(awk '{print $1}' /tmp/ph.txt | med) pack $(awk '{print $5}' /tmp/ph.txt | med) upload $(awk '{print $7}' /tmp/ph.txt | med) kernel $(awk '{print $9}' /tmp/ph.txt | med) download $(awk '{print $11}' /tmp/ph.txt | med) unpack $(awk '{print $13}' /tmp/ph.txt | med) ms"
  done
done
for v in rows_wc tiles_wc tiles_cached rows_cached; do for f in /tmp/res/p${N}_${v}_*.txt; do grep -E "^(prefill|decode) " $f | sed "s|^|ROW $v $(basename $f .txt | sed 's/.*_//') |"; done; done
head -3 /tmp/res/p${N}_tiles_wc_1.txt
cd /tmp/res && gzip -f *.err 2>/dev/null; tar czf $OUT/res.tgz . && ls -la $OUT
