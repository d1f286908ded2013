#!/usr/bin/env bash
# Runs each fuzz target for a bounded time (seconds, default 90) with cargo-fuzz on the
# nightly toolchain (AddressSanitizer + libFuzzer). Seeds come from make_seeds.py.
# Usage: ffi/fuzz/run.sh [SECONDS] [TARGET...]   (targets: model_open attention_desc tokenizer_files weight_blocks quantized_model session_file)
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-90}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(model_open attention_desc tokenizer_files weight_blocks quantized_model session_file)
python3 make_seeds.py
for t in "${targets[@]}"; do
  mkdir -p "artifacts/$t"
  cargo +nightly fuzz run -O "$t" "corpus/$t" -- \
    -max_total_time="$secs" -max_len=65536 -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 \
    2>&1 | tee "artifacts/$t/last-run.log" | grep -E "^(#[0-9]+ +(INITED|DONE|pulse))|stat::|ERROR|panicked|SUMMARY|Test unit" || true
done
