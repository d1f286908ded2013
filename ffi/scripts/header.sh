#!/usr/bin/env bash
# The C header ffi/include/foxedge.h is generated from ffi/src by cbindgen (ffi/build.rs,
# into the build's OUT_DIR); building never writes the committed copy. This script builds
# foxedge-ffi and then:
#   bash ffi/scripts/header.sh           copies the generated header to ffi/include/foxedge.h
#   bash ffi/scripts/header.sh --check   fails, showing the diff, if the committed one differs
# Env: CARGO_TARGET_DIR (default ./target), FFI_FEATURES (cargo feature flags; the header
# does not depend on them), PROFILE (debug|release, default debug).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
mode="${1:-write}"
case "$mode" in write | --check) ;; *)
  echo "usage: bash ffi/scripts/header.sh [--check]" >&2
  exit 2
  ;;
esac
cargo_profile=()
[ "${PROFILE:-debug}" = release ] && cargo_profile=(--release)
# The build script's OUT_DIR, from cargo's JSON messages (stdout); diagnostics go to stderr.
# shellcheck disable=SC2086
out_dir="$(cargo build -p foxedge-ffi --lib ${FFI_FEATURES-} "${cargo_profile[@]}" \
  --message-format=json-render-diagnostics |
  sed -n 's/.*"reason":"build-script-executed","package_id":"[^"]*#foxedge-ffi@[^"]*".*"out_dir":"\([^"]*\)".*/\1/p' |
  tail -n1)"
generated="$out_dir/foxedge.h"
if [ -z "$out_dir" ] || [ ! -f "$generated" ]; then
  echo "header.sh: cargo reported no OUT_DIR with foxedge.h for foxedge-ffi" >&2
  exit 1
fi
header="ffi/include/foxedge.h"
if [ "$mode" = --check ]; then
  if ! cmp -s "$header" "$generated"; then
    echo "$header is stale: cbindgen generates it differently from ffi/src. Diff:" >&2
    diff -u "$header" "$generated" >&2 || true
    echo "Regenerate it with: bash ffi/scripts/header.sh (then commit it)" >&2
    exit 1
  fi
  echo "header is current"
else
  mkdir -p "$(dirname "$header")"
  if cmp -s "$header" "$generated"; then
    echo "$header is current"
  else
    cp "$generated" "$header"
    echo "wrote $header"
  fi
fi
