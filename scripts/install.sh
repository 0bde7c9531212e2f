#!/usr/bin/env bash
# Install Slipstream (editable) into the current Python.
#
#   bash scripts/install.sh          # the package
#   bash scripts/install.sh test     # the package and what the tests need
#
# A torch that is already installed is kept. Without one, torch 2.13.0 is
# pinned: an unpinned `torch` pulls a multi-GB CUDA build, while 2.13.0 comes
# as a CPU wheel (and on GPU machines you will have installed your own).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "slipstream install: no torch found; installing torch==2.13.0" >&2
    "$PY" -m pip install -q "torch==2.13.0"
fi

case "${1:-}" in
    "") target="." ;;
    test) target=".[test]" ;;
    *) echo "usage: bash scripts/install.sh [test]" >&2; exit 2 ;;
esac
"$PY" -m pip install -q -e "$target"
"$PY" -c "import slipstream, torch; print(f'slipstream {slipstream.__version__} installed (torch {torch.__version__})')"
