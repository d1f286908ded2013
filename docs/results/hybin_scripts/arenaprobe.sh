#!/bin/bash
# arenaprobe.sh N: is auto's slower GPU kernel phase at 1k its context's larger pooled
# buffers? FOXEDGE_VULKAN_PROFILE=1 prefill benches; 1x16x1024 lines grouped by the pooled
# MiB they print (one group per context and arena size): count, median kernel, pack, upload.
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
mkdir -p /tmp/res
i=0
for spec in "vulkan 1k" "vulkan 16k,1k" "auto 1k" "vulkan,auto 1k" "vulkan 1k"; do
  set -- $spec; i=$((i+1))
  f=/tmp/res/ap${N}_$i
  FOXEDGE_VULKAN_PROFILE=1 timeout 110 .hybin/foxedge bench --backend $1 --ops prefill --lengths $2 --budget-s 1 > $f.txt 2> $f.err
  echo "## $i: --backend $1 --lengths $2"
  grep "prefill 1x16x1024x64" $f.err | sed 's/.*: decisions //; s/ ms; pooled buffers / /; s/ MiB.*//' | awk '{k=$14; n[k]++; K[k,n[k]]=$9; P[k,n[k]]=$5; U[k,n[k]]=$7}
    END { for (k in n) { m=n[k];
      for (c=0;c<3;c++) { for (i=1;i<=m;i++) a[i]=(c==0?K[k,i]:(c==1?P[k,i]:U[k,i]));
        for (i=2;i<=m;i++){x=a[i];j=i-1;while(j>0&&a[j]>x){a[j+1]=a[j];j--}a[j+1]=x} med[c]=a[int((m+1)/2)] }
      printf "pooled %s MiB: n %d kernel %s pack %s upload %s\n", k, m, med[0], med[1], med[2] } }'
  grep -E "^prefill " $f.txt | awk '{print "   ", $1, $2, $3, $4, $5}'
done
cd /tmp/res && gzip -f *.err 2>/dev/null; tar czf $OUT/res.tgz . && ls -la $OUT
