#!/usr/bin/env bash
# The whole-model prefill's matrix products on a GPU (issue 42), in one device call:
# 1. the product tests on the device (`model::matmul` of the foxedge-vulkan unit tests: every
#    kernel against the f64 product, and the cooperative-matrix kernel's, which lavapipe
#    skips), from a test binary built on the dev machine;
# 2. h200_model.sh (cpu and vulkan, the default kernels: cooperative matrices where the
#    device lists KHR f16 products) with FOXEDGE_VK_PROFILE=1;
# 3. the vulkan prefill again with each other kernel (FOXEDGE_VK_MM=simt, tile64);
# then each run's prefill tokens/s and its multi-row GPU profile (per kind, TFLOP/s of the
# products).
# Binaries in .vkbin/ (besides those h200_model.sh names):
#   cargo test --release -p foxedge-vulkan --lib --no-run   # prints target/release/deps/foxedge_vulkan-HASH
#   cp target/release/deps/foxedge_vulkan-HASH .vkbin/vk_lib_tests
# Usage (repository root): bash vulkan/scripts/h200_mm.sh [PROMPT=1024] [SIZE=760m]
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/vk_mm}"
mkdir -p "$out"
prompt_n="${1:-1024}"
size="${2:-760m}"
work="${MODELS:-/tmp/fox_models}"

# The model run first: it installs the Vulkan loader (.gl/) and writes the model.
echo "== $size, prompt $prompt_n: cpu and vulkan (default kernels)"
FOXEDGE_VK_PROFILE=1 OUT="$out/default" MODELS="$work" \
  bash vulkan/scripts/h200_model.sh "$prompt_n" 4 "$size" | grep -E "^\| $size" || echo "h200_model.sh failed"
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ] && ! ls /usr/share/vulkan/icd.d/*nvidia* >/dev/null 2>&1 && ! ls /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES="$icd"
fi

echo "== matmul tests on the device"
tests="${VK_LIB_TESTS:-.vkbin/vk_lib_tests}"
if [ -x "$tests" ]; then
  CI=1 "$tests" model::matmul --nocapture --test-threads 1 2>&1 |
    grep -E "SKIPPED|^test |test result|panicked|vs " | head -20
else
  echo "no .vkbin/vk_lib_tests (see the header)"
fi

prompt=$(python3 -c "import sys; n=int(sys.argv[1]); s='def f(x):\n    return x * 2\n'; print((s * (n // len(s) + 1))[:n])" "$prompt_n")
for mm in simt tile64; do
  mkdir -p "$out/$mm"
  FOXEDGE_VK_PROFILE=1 FOXEDGE_VK_MM="$mm" "${FOXEDGE_BIN:-.vkbin/foxedge}" generate --model "$work/$size" \
    --prompt "$prompt" --max-tokens 4 --backend vulkan --temperature 0 --json \
    >"$out/$mm/$size-vulkan.txt" 2>"$out/$mm/$size-vulkan.err" || echo "$mm: failed: $(tail -3 "$out/$mm/$size-vulkan.err")"
done

for run in default simt tile64; do
  f="$out/$run/$size-vulkan.txt"
  pre=$(tail -1 "$f" 2>/dev/null | python3 -c "import json,sys; print(round(json.loads(sys.stdin.read())['prefill_tokens_per_s'], 1))" 2>/dev/null)
  echo
  echo "== $run: vulkan prefill ${pre:-?} tok/s"
  grep -h "cooperative-matrix product does not build" "$out/$run/$size-vulkan.err" 2>/dev/null
  # The multi-row table of the stream with the most tokens (not the warm-up's).
  python3 - "$out/$run/$size-vulkan.err" <<'PY'
import re, sys
try:
    lines = open(sys.argv[1], errors="replace").read().splitlines()
except OSError:
    sys.exit(0)
best, most, cur, toks = [], -1, None, 0
for ln in lines + ["foxedge-vulkan: end"]:
    if ln.startswith("foxedge-vulkan:"):
        if cur is not None and toks > most:
            best, most = cur, toks
        cur = None
        m = re.search(r"multi-row runs \((\d+) tokens", ln)
        if m:
            cur, toks = [ln], int(m.group(1))
    elif cur is not None:
        cur.append(ln)
print("\n".join(best))
PY
done
