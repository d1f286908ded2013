#!/usr/bin/env bash
# Prefill kernels on the GPU machine, in one device call; every variant is checked on the
# device against the fixture and the CPU backend before it is timed.
#   bash vulkan/scripts/h100_prefill.sh           # variant comparison: ggml shapes
#                                                  # (8 heads = B 2 x H 4, L 2048 / 8192),
#                                                  # L 16384 B 8, L 4096 B 1
#   bash vulkan/scripts/h100_prefill.sh tables     # the BENCHMARKS.md prefill tables (H100)
# Variants: PREFILL_VARIANTS (vk_bench --kernels). Logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
status=0
if [ "${1:-}" = tables ]; then
  vars="${PREFILL_VARIANTS:-scalar16,cm,fa4,fa8,auto}"
  VK_LOG=prefill_table1.log bash vulkan/scripts/h100.sh --lengths 4096,16384 --batches 1,8 --decode none --kernels "$vars" || status=1
  VK_LOG=prefill_ggml.log bash vulkan/scripts/h100.sh --lengths 2048,8192 --batches 2 --decode none --kernels "$vars" || status=1
  logs="prefill_table1 prefill_ggml"
else
  vars="${PREFILL_VARIANTS:-cm,fa4,fa8}"
  VK_LOG=prefill_ggml.log bash vulkan/scripts/h100.sh --lengths 2048,8192 --batches 2 --decode none --kernels "$vars" || status=1
  VK_LOG=prefill_16k.log bash vulkan/scripts/h100.sh --lengths 16384 --batches 8 --decode none --kernels "$vars" || status=1
  VK_LOG=prefill_4k.log bash vulkan/scripts/h100.sh --lengths 4096 --batches 1 --decode none --kernels "$vars" || status=1
  logs="prefill_ggml prefill_16k prefill_4k"
fi
out="${OUT:-/tmp/vk_out}"
for f in $logs; do
  echo "== $f"
  sed -n '/^## prefill ms per variant/,/^## decode/p' "$out/$f.log" | grep '^|'
  grep -E "auto=" "$out/$f.log" | sort -u | head -40
  grep -E "CORRECTNESS|all correctness|FAIL|flash kernel" "$out/$f.log"
done
exit "$status"
