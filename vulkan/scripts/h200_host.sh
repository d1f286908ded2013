#!/usr/bin/env bash
# Host cost of a device decode token (issue 42): two foxedge binaries (BASE, NEW) on the
# same random byte-level FoX models, `generate --temperature 0` with FOXEDGE_VK_TIMING's
# host split per one-token step, NEW also under the settings that bear on that cost:
#   FOXEDGE_VK_FENCE=new            a fence created per submission (NEW resets and reuses one)
#   FOXEDGE_VK_CB_USAGE=simultaneous the step's command buffer recorded SIMULTANEOUS_USE
#   FOXEDGE_VK_REPLAY=0             the step recorded afresh for every token
#   FOXEDGE_VULKAN_SPIN_US=N        fence poll before the blocking wait (default 1000 on a GPU)
# One table row per (model, setting): decode tok/s and host µs per token: inputs (`record`),
# build, submit, wait, and `other` = 1e6 / (decode tok/s) - the four (the session's
# bookkeeping, sampling, statistics).
# Usage (repository root): bash vulkan/scripts/h200_host.sh BASE_BIN NEW_BIN [PROMPT=1024]
#   [DECODE=128] ["125m 760m"]; models in $MODELS (default /tmp/fox_models, made with
#   tools/make_fox_model.py --vocab 256 when missing), logs in $OUT (default /tmp/vk_host).
set -uo pipefail
cd "$(dirname "$0")/../.."
base="$1"
new="$2"
prompt_n="${3:-1024}"
decode_n="${4:-128}"
sizes="${5:-125m 760m}"
work="${MODELS:-/tmp/fox_models}"
out="${OUT:-/tmp/vk_host}"
mkdir -p "$out" "$work"
for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
ldconfig 2>/dev/null || true
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ] && ! ls /usr/share/vulkan/icd.d/*nvidia* >/dev/null 2>&1 && ! ls /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES="$icd"
fi
prompt=$(python3 -c "import sys; n=int(sys.argv[1]); s='def f(x):\n    return x * 2\n'; print((s * (n // len(s) + 1))[:n])" "$prompt_n")
settings=(
  "base|$base|"
  "new|$new|"
  "new fence=new|$new|FOXEDGE_VK_FENCE=new"
  "new cb=simultaneous|$new|FOXEDGE_VK_CB_USAGE=simultaneous"
  "new replay=0|$new|FOXEDGE_VK_REPLAY=0"
  "new spin=0|$new|FOXEDGE_VULKAN_SPIN_US=0"
  "new spin=20000|$new|FOXEDGE_VULKAN_SPIN_US=20000"
)
echo "| model | setting | decode tok/s | inputs µs | build µs | submit µs | wait µs | other µs |"
echo "|---|---|---|---|---|---|---|---|"
for size in $sizes; do
  dir="$work/$size"
  [ -f "$dir/model.safetensors" ] || python3 tools/make_fox_model.py "$dir" "$size" --dtype f32 --vocab 256 >/dev/null || exit 1
  for s in "${settings[@]}"; do
    IFS='|' read -r name bin envs <<<"$s"
    log="$out/$size-${name// /_}"
    # shellcheck disable=SC2086
    env FOXEDGE_VK_TIMING=1 $envs "$bin" generate --model "$dir" --prompt "$prompt" \
      --max-tokens "$decode_n" --backend vulkan --temperature 0 --json >"$log.txt" 2>"$log.err" ||
      { echo "| $size | $name | failed: $(tail -1 "$log.err") |"; continue; }
    python3 - "$size" "$name" "$log.txt" "$log.err" <<'PY'
import json, re, sys
size, name, txt, err = sys.argv[1:]
s = json.loads(open(txt, "rb").read().strip().splitlines()[-1].decode())
line = [l for l in open(err) if "one-token steps" in l][-1]
v = {k: float(x) for k, x in re.findall(r"(record|build|submit|wait) (\d+)", line)}
tps = s["decode_tokens_per_s"]
other = 1e6 / tps - sum(v.values())
print(f"| {size} | {name} | {tps:.1f} | {v['record']:.0f} | {v['build']:.0f} | {v['submit']:.0f} | {v['wait']:.0f} | {other:.0f} |")
PY
  done
done
