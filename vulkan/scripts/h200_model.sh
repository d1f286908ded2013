#!/usr/bin/env bash
# The whole model on the GPU against the CPU backend (issue 42), in one device call: random
# FoX-Pro models (125M and 760M, tools/make_fox_model.py), `foxedge generate` on the
# cpu and vulkan backends (prefill of a PROMPT-byte prompt, then DECODE greedy tokens), the
# device's read bandwidth (examples/vk_bandwidth: a compute shader streaming a buffer), and a table with the decode bandwidth
# bound: (weight bytes read per token + cache bytes per token) / bandwidth. The models are
# written in f32; WEIGHTS=f16|bf16|q8|q4 passes `--weights WEIGHTS` to both backends (held
# in that format, the device reading 4, 2, 2, 34/32 or 18/32 bytes per weight; the bound
# uses the format's bytes; the forget-gate and shift projections, a few per mille of the
# weights, stay f32 and are counted at the format's size). The models are byte-level (vocab
# 256, as `foxedge generate` streams bytes): the official shapes otherwise, without the
# 50257-row LM head.
#
# On the GPU machine it needs the Vulkan loader as .deb files in .gl/ (as h100.sh), and
# either cargo (it builds release there) or binaries built on the dev machine and carried
# in .vkbin/:
#   cargo build --release -p foxedge --bin foxedge
#   cargo build --release -p foxedge-vulkan --example vk_bandwidth
#   mkdir -p .vkbin && cp target/release/foxedge target/release/examples/vk_bandwidth .vkbin/
# Usage (repository root): [WEIGHTS=q8] bash vulkan/scripts/h200_model.sh [PROMPT=2048] [DECODE=128] ["125m 760m"]
# Logs and JSON in $OUT (default /tmp/vk_out); FOXEDGE_BIN and VK_BANDWIDTH_BIN name other
# binaries (e.g. debug builds for a dry run on lavapipe with the size "tiny").
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/vk_out}"
work="${MODELS:-/tmp/fox_models}"
mkdir -p "$out" "$work"
prompt_n="${1:-2048}"
decode_n="${2:-128}"
sizes="${3:-125m 760m}"
weights="${WEIGHTS:-}"
wargs=()
[ -n "$weights" ] && wargs=(--weights "$weights")
tag="${weights:+-$weights}"

for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
ldconfig 2>/dev/null || true
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ] && ! ls /usr/share/vulkan/icd.d/*nvidia* >/dev/null 2>&1 && ! ls /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES="$icd"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"

if [ -n "${FOXEDGE_BIN:-}" ]; then
  bin="$FOXEDGE_BIN"
  bwbin="${VK_BANDWIDTH_BIN:?set with FOXEDGE_BIN}"
elif command -v cargo >/dev/null 2>&1; then
  cargo build --release -p foxedge --bin foxedge >"$out/build.log" 2>&1 &&
    cargo build --release -p foxedge-vulkan --example vk_bandwidth >>"$out/build.log" 2>&1 ||
    { tail -30 "$out/build.log"; exit 1; }
  bin=target/release/foxedge
  bwbin=target/release/examples/vk_bandwidth
else
  bin=.vkbin/foxedge
  bwbin=.vkbin/vk_bandwidth
fi
[ -x "$bin" ] && [ -x "$bwbin" ] || { echo "no foxedge / vk_bandwidth binaries (see the header)"; exit 1; }

bws=$("$bwbin" "${BW_MIB:-2048}" 20) || { echo "bandwidth probe failed"; exit 1; }
bw=${bws%% *}
echo "device read bandwidth: $bw GB/s (copy, read + write: ${bws##* } GB/s)" | tee "$out/bandwidth.txt"

prompt=$(python3 -c "import sys; n=int(sys.argv[1]); s='def f(x):\n    return x * 2\n'; print((s * (n // len(s) + 1))[:n])" "$prompt_n")
status=0
for size in $sizes; do
  dir="$work/$size"
  [ -f "$dir/model.safetensors" ] || python3 tools/make_fox_model.py "$dir" "$size" --dtype f32 --vocab 256 || exit 1
  for be in cpu vulkan; do
    echo "== $size $be"
    if ! "$bin" generate --model "$dir" --prompt "$prompt" --max-tokens "$decode_n" \
        --backend "$be" "${wargs[@]}" --temperature 0 --json \
        >"$out/$size-$be$tag.txt" 2>"$out/$size-$be$tag.err"; then
      echo "failed: $(tail -3 "$out/$size-$be$tag.err")"
      status=1
    fi
    tail -1 "$out/$size-$be$tag.txt"
  done
done

python3 - "$out" "$work" "$bw" "$sizes" "$weights" <<'PY'
import json, math, struct, sys, os
out, work, bw, sizes = sys.argv[1], sys.argv[2], float(sys.argv[3]) * 1e9, sys.argv[4].split()
fmt = sys.argv[5] or "f32"
tag = f"-{sys.argv[5]}" if sys.argv[5] else ""
bpw = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8": 34 / 32, "q4": 18 / 32}[fmt]
def stats(path):
    try:
        return json.loads(open(path, "rb").read().strip().splitlines()[-1].decode())
    except Exception:
        return None
print(f"\nbandwidth {bw/1e9:.0f} GB/s (compute-shader read), weights {fmt}")
print("| model | backend | prefill tok/s | decode tok/s | decode bound tok/s | % of bound | device layers | submissions / decode token | vs cpu prefill | vs cpu decode |")
print("|---|---|---|---|---|---|---|---|---|---|")
for size in sizes:
    d = os.path.join(work, size)
    cfg = json.load(open(os.path.join(d, "config.json")))
    with open(os.path.join(d, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    params = [k for k in hdr if k != "__metadata__"]
    numel = lambda k: math.prod(hdr[k]["shape"])
    total = sum(numel(k) for k in params)
    emb = numel("model.embeddings.weight")
    L, H, D = cfg["num_hidden_layers"], cfg["num_heads"], cfg["hidden_size"]
    hd = D // H
    c, g = stats(os.path.join(out, f"{size}-cpu{tag}.txt")), stats(os.path.join(out, f"{size}-vulkan{tag}.txt"))
    for name, s in (("cpu", c), ("vulkan", g)):
        if s is None:
            print(f"| {size} | {name} | failed | | | | | | | |")
            continue
        live = s["live_entries"] / max(L * H, 1)
        per_token = bpw * (total - emb) + L * H * live * (2 * hd * 4 + 16)
        bound = bw / per_token
        dec, pre = s["decode_tokens_per_s"], s["prefill_tokens_per_s"]
        dec = dec if isinstance(dec, float) else 0.0
        pre = pre if isinstance(pre, float) else 0.0
        vs = lambda a, b: f"{a / b:.2f}x" if c and isinstance(b, float) and b > 0 else ""
        # The prompt is one fresh chunk (layers + 1 submissions); every other is decode.
        subs = s.get("device_submissions", 0)
        per_dec = f"{(subs - (L + 1)) / s['decode_tokens']:.2f}" if subs and s["decode_tokens"] else ""
        print(f"| {size} | {name} | {pre:.1f} | {dec:.1f} | {bound:.0f} | {100 * dec / bound:.1f}% | "
              f"{s.get('device_layers', 0)} | {per_dec} | {vs(pre, c['prefill_tokens_per_s']) if c else ''} | "
              f"{vs(dec, c['decode_tokens_per_s']) if c else ''} |")
PY
exit "$status"
