#!/usr/bin/env bash
# The wheels folder benchmarks/gpu_check.sh installs from on a GPU machine with no network whose
# image has python 3.12, a CUDA torch and its triton: made beforehand here, where there is a
# network, and kept under 64 MiB (what travels with the work tree to such a machine).
#   benchmarks/gpu_wheels.sh [--python-version X.Y] [--core] OUT_DIR
#   then: benchmarks/gpu_check.sh --wheels OUT_DIR RESULTS
# Always: this project's wheel, optree, numpy, pytest and pytest-xdist (with their dependencies).
# Then, unless --core, the anchors, smallest first, each while the folder stays under the limit:
# FlashOptim, torchao, bitsandbytes (the parity extra's versions); one that does not fit is named
# and left out. --python-version: the Python the wheels are for (3.12, the GPU image's, unless
# given; gpu_check.sh --rehearse makes them for the Python that runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=3.12
CORE=0
while [ $# -gt 1 ]; do
  case "$1" in
    --python-version) PYV="${2:?--python-version needs X.Y}"; shift 2 ;;
    --core) CORE=1; shift ;;
    *) echo "unknown option $1 (usage: benchmarks/gpu_wheels.sh [--python-version X.Y] [--core] OUT_DIR)" >&2; exit 2 ;;
  esac
done
OUT="${1:?usage: benchmarks/gpu_wheels.sh [--python-version X.Y] [--core] OUT_DIR}"
[[ "$PYV" =~ ^3\.[0-9]+$ ]] || { echo "--python-version $PYV: give it as 3.12" >&2; exit 2; }
ABI="cp${PYV/./}"
LIMIT=$((64 * 1024 * 1024))
PY="${PYTHON:-python}"
mkdir -p "$OUT"
# wheels for CPython $PYV on x86-64 Linux, whatever this machine runs
get() {
  "$PY" -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp --abi "$ABI" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$OUT" "$@" 2>&1 | { grep -v "is ignored" || true; }
}
size() { du -sb "$OUT" | cut -f1; }

src=$(mktemp -d)  # built from a copy of the work tree's files, leaving no build folders in it
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$src"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$src" 2>&1 | { grep -v "is ignored" || true; }
rm -rf "$src"
get "optree>=0.13" "numpy" "pytest>=8" "pytest-xdist>=3.2"  # with their dependencies (typing-extensions, pluggy, execnet, ...)
# the anchors without their dependencies (torch and triton are the image's)
PARITY=$(sed -n 's/^parity = \[\(.*\)\]/\1/p' pyproject.toml | tr -d '" ' | tr ',' ' ')
ANCHORS="flashoptim $PARITY"
[ "$CORE" = 0 ] || ANCHORS=""
for pkg in $ANCHORS; do
  tmp=$(mktemp -d)
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --abi "$ABI" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$tmp" "$pkg" >"$tmp.log" 2>&1; then
    echo "left out: $pkg (no $ABI wheel could be downloaded: $(tail -n 1 "$tmp.log"))"
    rm -rf "$tmp" "$tmp.log"
    continue
  fi
  rm -f "$tmp.log"
  add=$(du -sb "$tmp" | cut -f1)
  if [ $(( $(size) + add )) -lt "$LIMIT" ]; then
    mv "$tmp"/*.whl "$OUT"/
  else
    echo "left out: $pkg ($((add / 1024 / 1024)) MiB would pass the 64 MiB limit)"
  fi
  rm -rf "$tmp"
done
ls -1 "$OUT"
ls "$OUT"/lowbit_tree-*.whl >/dev/null || { echo "the project's wheel is missing from $OUT" >&2; exit 1; }
total=$(size)
echo "$OUT: $((total / 1024)) KiB"
[ "$total" -lt "$LIMIT" ] || { echo "over the 64 MiB limit" >&2; exit 1; }
