#!/bin/bash
# headscale.sh N: Vulkan prefill host phases against head count (2..16) at 1K and 4K tokens,
# f32 inputs (seq-first, as the facade's), profile medians per shape.
N=$1
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
xz -dc .hybin/vkph.xz > /tmp/vkph && chmod +x /tmp/vkph
mkdir -p /tmp/res
for h in 2 4 8 11 16 8 4 2; do
  for t in "" --f16; do FOXEDGE_VULKAN_PROFILE=1 /tmp/vkph --heads $h --lengths 1024,4096 --seq-first --acp --reps 41 $t >> /tmp/res/hs$N.txt 2>> /tmp/res/hs$N.err; done
done
grep -v "^device" /tmp/res/hs$N.txt | cut -c1-120
grep "foxedge-vulkan prefill" /tmp/res/hs$N.err | awk '{k=$3" "$4" "$7; for(i=1;i<=NF;i++) if ($i ~ /^(decisions|setup|pack|upload|kernel|download|unpack)$/) {v[k,$i,++c[k,$i]]=$(i+1)}; n[k]++} END {for (kk in n) {printf "%s n=%d", kk, n[kk]; split("decisions setup pack upload kernel download unpack",a," "); for (j=1;j<=7;j++) {m=c[kk,a[j]]; for(x=1;x<=m;x++) b[x]=v[kk,a[j],x]; for(x=2;x<=m;x++){y=b[x];z=x-1;while(z>0&&b[z]>y){b[z+1]=b[z];z--}b[z+1]=y}; printf " %s %.3f", a[j], b[int((m+1)/2)]}; print ""}}' | sort
cd /tmp/res && gzip -f *.err; tar czf $OUT/res.tgz . 
