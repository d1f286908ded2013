#!/usr/bin/env bash
# C ABI checks, run by .ci/run (from any directory):
#   1. build the C library (ffi/clib: libfoxedge.so with soname libfoxedge.so.0, and
#      libfoxedge.a) and check that the committed include/foxedge.h is what cbindgen
#      generates from ffi/src (ffi/scripts/header.sh --check; regenerate with
#      `bash ffi/scripts/header.sh`);
#   2. stage an install tree (lib/, include/foxedge/, lib/pkgconfig/foxedge.pc, cargo-c
#      layout) and compile the header as C11 and C++;
#   3. build ffi/examples/stream.c (shared library, via pkg-config) and run it on the tiny
#      model; build ffi/tests/c_errors.c and ffi/tests/c_sessions.c (static library,
#      pkg-config --static) and run them.
# Env: CARGO_TARGET_DIR (default ./target), FFI_FEATURES (cargo feature flags for the
# crates; default none, i.e. with Vulkan, the same build `cargo test --workspace` made;
# "--no-default-features" builds without Vulkan), PROFILE (debug|release, default debug).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
profile="${PROFILE:-debug}"
features="${FFI_FEATURES-}"
step() { printf '\n---- ffi: %s\n' "$*"; }

step "build the C library ($profile)"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo_profile=()
[ "$profile" = release ] && cargo_profile=(--release)
# `cargo rustc` builds the lib's crate types (cdylib, staticlib) like `cargo build` and lets
# rustc print the system libraries the static library needs (for foxedge.pc). A fresh build
# prints nothing, so the list is kept beside the library.
build() {
  # shellcheck disable=SC2086
  cargo rustc -p foxedge-clib --lib $features "${cargo_profile[@]}" -- --print native-static-libs \
    2>&1 | tee "$log"
}
build
libs_file="$target/$profile/libfoxedge.native-static-libs"
native="$(sed -n 's/.*native-static-libs: //p' "$log" | tail -n1)"
if [ -n "$native" ]; then
  echo "$native" >"$libs_file"
elif [ -f "$libs_file" ]; then
  native="$(cat "$libs_file")"
else
  touch ffi/clib/src/lib.rs && build
  native="$(sed -n 's/.*native-static-libs: //p' "$log" | tail -n1)"
  echo "$native" >"$libs_file"
fi
for f in libfoxedge.so libfoxedge.a; do
  [ -f "$target/$profile/$f" ] || { echo "the build made no $target/$profile/$f" >&2; exit 1; }
done

step "the committed header is current"
bash ffi/scripts/header.sh --check
header="ffi/include/foxedge.h"

step "stage install tree and pkg-config file"
stage="$target/ffi-stage"
libdir="$stage/lib"
rm -rf "$stage"
mkdir -p "$libdir/pkgconfig" "$stage/include/foxedge"
cp "$target/$profile/libfoxedge.a" "$libdir/libfoxedge.a"
cp "$target/$profile/libfoxedge.so" "$libdir/libfoxedge.so.0.1.0"
ln -s libfoxedge.so.0.1.0 "$libdir/libfoxedge.so.0"
ln -s libfoxedge.so.0 "$libdir/libfoxedge.so"
soname="$(readelf -d "$libdir/libfoxedge.so.0.1.0" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')"
if [ "$soname" != libfoxedge.so.0 ]; then
  echo "libfoxedge.so has soname '$soname', expected libfoxedge.so.0" >&2
  exit 1
fi
echo "soname $soname"
cp "$header" "$stage/include/foxedge/"
bash ffi/scripts/pkgconfig.sh "$stage" "$native" >"$libdir/pkgconfig/foxedge.pc"
cat "$libdir/pkgconfig/foxedge.pc"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
pkg-config --exists --print-errors foxedge
cflags="$(pkg-config --cflags foxedge)"

step "header compiles as C11 and C++17"
warn=(-Wall -Wextra -Werror -pedantic)
echo '#include <foxedge.h>' | gcc -std=c11 "${warn[@]}" $cflags -x c -fsyntax-only -
echo '#include <foxedge.h>' | g++ -std=c++17 "${warn[@]}" $cflags -x c++ -fsyntax-only -

step "ffi/examples/stream.c (shared library)"
bin="$target/ffi-bin"
mkdir -p "$bin"
# shellcheck disable=SC2046
gcc -std=c11 "${warn[@]}" -O2 ffi/examples/stream.c -o "$bin/stream" \
  $(pkg-config --cflags --libs foxedge) -Wl,-rpath,"$libdir"
"$bin/stream" models/fox-tiny-pro

step "ffi/tests/c_errors.c (static library)"
# shellcheck disable=SC2046
gcc -std=c11 "${warn[@]}" -O1 ffi/tests/c_errors.c -o "$bin/c_errors" \
  $(pkg-config --static --cflags --libs foxedge | sed 's/-lfoxedge\b/-l:libfoxedge.a/')
"$bin/c_errors" models/fox-tiny-pro

step "ffi/tests/c_sessions.c (static library)"
# shellcheck disable=SC2046
gcc -std=c11 "${warn[@]}" -O1 ffi/tests/c_sessions.c -o "$bin/c_sessions" \
  $(pkg-config --static --cflags --libs foxedge | sed 's/-lfoxedge\b/-l:libfoxedge.a/')
"$bin/c_sessions" models/fox-tiny-pro

step "ok"
