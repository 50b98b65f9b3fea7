#!/usr/bin/env bash
# The fast tier (-m "not slow") under the other torches CI tests, each in a virtual environment of
# its own: torch 2.11.0 with triton 3.6.0 (the GPU image's pair) and torch 2.14.1 (the newest
# release PyPI serves). The README's test command in .ci/run covers torch 2.13.0.
#
# The venvs live in a cache folder outside the clone and are reused while their requirements are
# unchanged, so a warm run only runs the tests. PyPI's torch wheel for Linux x86-64 is a CUDA build:
# it brings the nvidia-* libraries (several GB the first time; there is no CPU build on PyPI) and
# runs on the CPU. The project itself is not installed there: the tests import this tree
# (PYTHONPATH), with pyproject.toml's dependencies and test extra installed beside the pinned torch.
#
#   bash .ci/torch_versions.sh            # make or reuse the venvs, run the fast tier under each
#   bash .ci/torch_versions.sh --prepare  # only make or reuse the venvs
#
# Prints one line per torch with pytest's summary and the seconds it took; exits non-zero when a
# venv cannot be made or a tier fails or runs no test (pytest's exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."

# torch pin, then the other pins of that venv (the triton each torch wheel asks for: 2.11.0 requires
# triton==3.6.0, 2.14.1 triton~=3.8.0). tests/test_ci.py checks these against pyproject.toml and README.md.
TORCHES=(
    "torch==2.11.0 triton==3.6.0"
    "torch==2.14.1 triton==3.8.0"
)

PREPARE_ONLY=0
case "${1:-}" in
    "") ;;
    --prepare) PREPARE_ONLY=1 ;;
    *) echo "usage: $0 [--prepare]" >&2; exit 2 ;;
esac

VENVS=${LOWBIT_TREE_CI_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/lowbit-tree-ci/venvs}
PY=${PYTHON:-python3}
mkdir -p "$VENVS"

# pyproject.toml's dependencies and test extra, one a line (tomllib: Python 3.11 or later).
mapfile -t PROJECT_REQS < <("$PY" - <<'EOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:
    sys.exit(f"{sys.executable} is Python {sys.version.split()[0]}: .ci/torch_versions.sh reads pyproject.toml with tomllib (3.11 or later); set PYTHON")
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
EOF
)
[ "${#PROJECT_REQS[@]}" -gt 0 ] || { echo "no requirements read from pyproject.toml" >&2; exit 1; }

# Venvs of torches no longer listed are removed: each holds several GB.
keep=()
for spec in "${TORCHES[@]}"; do
    torch_pin=${spec%% *}
    keep+=("torch-${torch_pin#torch==}")
done
for dir in "$VENVS"/torch-*; do
    [ -d "$dir" ] || continue
    case " ${keep[*]} " in *" $(basename "$dir") "*) ;; *) echo "removing $dir (no longer tested)"; rm -rf "$dir" ;; esac
done

prepare() {  # prepare VENV PIN...: make or reuse the venv with these requirements
    local venv=$1; shift
    local reqs=("$@" "${PROJECT_REQS[@]}")
    local pyver stamp
    pyver=$("$PY" -c 'import sys; print(sys.version)')
    stamp="$pyver | ${reqs[*]}"
    if [ -x "$venv/bin/python" ] && [ -f "$venv/.lowbit-tree-reqs" ] && [ "$(cat "$venv/.lowbit-tree-reqs")" = "$stamp" ]; then
        echo "reusing $venv"
        return 0
    fi
    # Another Python (or a broken venv) starts afresh; changed requirements are installed over it.
    if ! [ -x "$venv/bin/python" ] || [ "$("$venv/bin/python" -c 'import sys; print(sys.version)' 2>/dev/null)" != "$pyver" ]; then
        rm -rf "$venv"
    fi
    echo "making $venv: ${reqs[*]}"
    rm -f "$venv/.lowbit-tree-reqs"
    "$PY" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "${reqs[@]}"
    echo "$stamp" > "$venv/.lowbit-tree-reqs"
}

for spec in "${TORCHES[@]}"; do
    read -r -a pins <<< "$spec"
    started=$SECONDS
    prepare "$VENVS/torch-${pins[0]#torch==}" "${pins[@]}"
    echo "$spec: venv ready in $((SECONDS - started)) s"
done
[ "$PREPARE_ONLY" -eq 0 ] || exit 0

failed=0
summaries=()
for spec in "${TORCHES[@]}"; do
    read -r -a pins <<< "$spec"
    venv="$VENVS/torch-${pins[0]#torch==}"
    # What the venv imports must be what it pins, and the tree must be this clone's.
    PYTHONPATH=$PWD "$venv/bin/python" - "${pins[@]}" <<'EOF'
import importlib.metadata, os, sys
import lowbit_tree
if not os.path.abspath(lowbit_tree.__file__).startswith(os.getcwd() + os.sep):
    sys.exit(f"lowbit_tree imports from {lowbit_tree.__file__}, not this clone")
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    have = importlib.metadata.version(name)
    if have.split("+")[0] != want:
        sys.exit(f"{name} {have} is installed where {want} is pinned")
EOF
    echo "== the fast tier with $spec ($venv)"
    log=$(mktemp)
    started=$SECONDS
    set +e
    PYTHONPATH=$PWD "$venv/bin/python" -m pytest -n 2 -q -p no:cacheprovider -m "not slow" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    line=$(grep -E '^=* ?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran' "$log" | tail -n 1 || true)
    summaries+=("$spec: exit $rc, ${line:-no summary line} ($((SECONDS - started)) s)")
    rm -f "$log"
    if [ "$rc" -ne 0 ]; then  # 5 (no tests ran) included
        failed=1
    fi
done
echo "== the fast tier under each torch"
printf '%s\n' "${summaries[@]}"
exit "$failed"
