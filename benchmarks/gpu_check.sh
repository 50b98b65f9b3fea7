#!/usr/bin/env bash
# The GPU check in one command: benchmarks/gpu_check.py (its docstring says every option, the
# steps, their budgets and the exit codes; docs/guide/gpu.md has the budget table).
#   benchmarks/gpu_check.sh [--wheels DIR] [--rehearse] [--only STEP,...] [RESULTS]
# This entry only finds a Python 3 (PYTHON, else python3, else python): no Python is the
# preflight's first failure (exit 3).
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-$(command -v python3 || command -v python)}"
if [ -z "$PY" ] || ! "$PY" -c "import sys; sys.exit(sys.version_info < (3, 10))" 2>/dev/null; then
  echo "FAIL preflight python: no Python 3.10 or later (PYTHON, python3 or python on PATH)" >&2
  exit 3
fi
exec "$PY" benchmarks/gpu_check.py "$@"
