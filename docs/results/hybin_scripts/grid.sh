#!/bin/bash
# grid.sh N JOB...: JOB = BIN:OPS[:LENGTHS] (BIN: c = .hybin/foxedge, m = .hybin/main), each a
# `bench --full --ops OPS [--lengths L] --budget-s 2` run without control engines, numbered N, N+1, ...
# A job is skipped when its estimate (EST_prefill/EST_decode s, scaled for fewer lengths) would
# pass the call's deadline D (s); results (json, table, stderr) go into $OUT/res.tgz.
N=$1; shift
source .hybin/setup.sh
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f .hybin/main.xz ] && [ ! -x .hybin/main ] && xz -dc .hybin/main.xz > .hybin/main && chmod +x .hybin/main
R=/tmp/res; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo; date -u; } > $R/machine_$N.txt 2>&1
cat $R/machine_$N.txt
i=$N
for j in "$@"; do
  IFS=: read b ops lens <<< "$j"
  case $b in c) BIN=.hybin/foxedge;; m) BIN=.hybin/main;; esac
  if [ "$ops" = prefill ]; then est=${EST_prefill:-150}; else est=${EST_decode:-80}; fi
  [ -n "$lens" ] && est=$(( est * $(echo $lens | tr ',' '\n' | wc -l) / 4 + 10 ))
  if [ $((SECONDS + est)) -gt ${D:-570} ]; then echo "== $i $j skipped at ${SECONDS}s (est $est)"; continue; fi
  S=$SECONDS
  timeout $((est * 2)) $BIN bench --full --ops $ops ${lens:+--lengths $lens} --budget-s 2 --out $R/run$i.json > $R/run${i}_table.txt 2> >(gzip > $R/run${i}_stderr.txt.gz)
  echo "== $i $j rc $? in $((SECONDS - S)) s"
  grep "^| \(prefill\|decode\)" $R/run${i}_table.txt | awk -F'|' '{print $2,$3,$(NF-2),$(NF-1)}' | cut -c1-200
  echo "$i $j" >> $R/order.txt
  i=$((i + 1))
done
sleep 1
(cd $R && tar czf $OUT/res.tgz .)
