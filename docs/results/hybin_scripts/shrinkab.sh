#!/bin/bash
# shrinkab.sh N0 PAIRS: one binary, old = FOXEDGE_TMP_NO_SHRINK=1 (pooled prefill buffers
# only grow), new = they shrink back (vulkan/src/arena.rs). First the arena probe: profiled
# 1x16x1024 prefill phases grouped by pooled MiB, per variant, for --backend vulkan
# --lengths 16k,1k and --backend auto --lengths 1k. Then PAIRS ABBA pairs of full prefill
# 1k,4k runs; one tgz back.
N=$1; P=${2:-2}
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
envof() { if [ $1 = old ]; then echo "FOXEDGE_TMP_NO_SHRINK=1"; else echo "FOXEDGE_TMP_NONE=1"; fi; }
i=0
for v in old new; do for spec in "vulkan 16k,1k" "auto 1k"; do
  set -- $spec; i=$((i+1))
  f=/tmp/res/sp${N}_${v}_$i
  env $(envof $v) FOXEDGE_VULKAN_PROFILE=1 timeout 110 .hybin/foxedge bench --backend $1 --ops prefill --lengths $2 --budget-s 1 > $f.txt 2> $f.err
  echo "## $v: --backend $1 --lengths $2"
  grep "prefill 1x16x1024x64" $f.err | sed 's/.*: decisions //; s/ ms; pooled buffers / /; s/ MiB.*//' | awk '{k=$14; n[k]++; K[k,n[k]]=$9; P[k,n[k]]=$5; U[k,n[k]]=$7}
    END { for (k in n) { m=n[k];
      for (c=0;c<3;c++) { for (i=1;i<=m;i++) a[i]=(c==0?K[k,i]:(c==1?P[k,i]:U[k,i]));
        for (i=2;i<=m;i++){x=a[i];j=i-1;while(j>0&&a[j]>x){a[j+1]=a[j];j--}a[j+1]=x} med[c]=a[int((m+1)/2)] }
      printf "pooled %s MiB: n %d kernel %s pack %s upload %s\n", k, m, med[0], med[1], med[2] } }'
  grep -E "^prefill " $f.txt | awk '{print "   ", $1, $2, $3, $4, $5}'
done; done
for p in $(seq 1 $P); do
  if [ $((p % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for b in $order; do
    env $(envof $b) T=110 OUT=/tmp/res bash .hybin/full.sh $N --ops prefill --lengths 1k,4k --budget-s 3 > /dev/null 2>&1
    echo "# run $N $b"; grep "^| prefill" /tmp/res/run${N}_table.txt
    N=$((N+1))
  done
done
cd /tmp/res && gzip -f *.err 2>/dev/null; tar czf $OUT/res.tgz . && ls -la $OUT
