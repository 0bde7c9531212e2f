#!/usr/bin/env bash
# Install Slipstream (editable) into the current Python.
#
#   bash scripts/install.sh          # the package
#   bash scripts/install.sh test     # the package with every extra, and the test tools
#   bash scripts/install.sh bench    # the package, and the benchmark peers (DeepSpeed, ...)
#
# A torch that is already installed is never replaced: every pip call below runs
# with a constraints file pinning it (`torch==<installed version>`), whatever the
# extras pull. Without one, torch 2.13.0 is installed first: an unpinned `torch`
# pulls a multi-GB CUDA build, while 2.13.0 comes as a CPU wheel here. On a GPU
# machine, install the torch build you want first, e.g.
#   pip install torch --index-url https://download.pytorch.org/whl/cu128
# and this script keeps it.
#
# test/bench are PEP 735 dependency groups in pyproject.toml. pip >= 25.1 installs
# them itself (`pip install --group`); with an older pip (23.2 here) this script
# reads the group from pyproject.toml and passes its requirements to pip, so the
# user's pip is left as it is.
#
# SLIPSTREAM_PIP_REPORT_DIR=DIR: resolve only (`pip install --dry-run --report`),
# one JSON report per pip call in DIR; nothing is installed (tests/packaging).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

group="${1:-}"
case "$group" in
    "") target="." ;;
    test) target=".[all]" ;;
    bench) target="."; export DS_BUILD_OPS="${DS_BUILD_OPS:-0}" ;;
    *) echo "usage: bash scripts/install.sh [test|bench]" >&2; exit 2 ;;
esac

report_dir="${SLIPSTREAM_PIP_REPORT_DIR:-}"
calls=0
pip_install() {  # every pip call goes through here: always constrained to the torch we keep
    calls=$((calls + 1))
    local extra=()
    if [ -n "$report_dir" ]; then
        extra=(--dry-run --report "$report_dir/pip-$calls.json")
    fi
    "$PY" -m pip install -q -c "$constraints" "${extra[@]}" "$@"
}

constraints="$(mktemp "${TMPDIR:-/tmp}/slipstream-constraints.XXXXXX")"
trap 'rm -f "$constraints"' EXIT

torch_version="$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null || true)"
if [ -z "$torch_version" ]; then
    torch_version="2.13.0"
    echo "torch==$torch_version" >"$constraints"
    echo "slipstream install: no torch found; installing torch==$torch_version" >&2
    pip_install "torch==$torch_version"
else
    echo "torch==$torch_version" >"$constraints"
fi

pip_install -e "$target"

# Then the group, with everything now installed pinned too: it may add packages but never
# change one (e.g. moto's boto3 must take the botocore that s3fs's aiobotocore pinned).
# One call for both would be simpler, but pip 23.2's resolver gives up on that set.
group_args=()
if [ -n "$group" ]; then
    if "$PY" -m pip install --help 2>/dev/null | grep -q -- "--group"; then
        group_args=(--group "$group")
    else
        mapfile -t group_args < <("$PY" - "$group" <<'PYEOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the TOML reader pip itself ships
    from pip._vendor import tomli as tomllib

groups = tomllib.load(open("pyproject.toml", "rb"))["dependency-groups"]

def expand(name, seen=()):
    if name in seen:
        raise SystemExit(f"dependency group {name!r} includes itself")
    for item in groups[name]:
        if isinstance(item, dict):  # {include-group = "..."}
            yield from expand(item["include-group"], (*seen, name))
        else:
            yield item

print("\n".join(expand(sys.argv[1])))
PYEOF
)
    fi
fi
if [ -n "$group" ]; then
    # Pin what is installed, but for the packages the group names itself (they may upgrade).
    names="$(printf '%s\n' "${group_args[@]}" | sed -E 's/[][<>=!~;, ].*//' | tr 'A-Z_.' 'a-z--' | grep -v '^--' || true)"
    "$PY" -m pip list --format=freeze --exclude-editable 2>/dev/null | while IFS= read -r line; do
        name="$(printf '%s' "${line%%==*}" | tr 'A-Z_.' 'a-z--')"
        if ! grep -qxF -- "$name" <<<"$names"; then printf '%s\n' "$line"; fi
    done >>"$constraints"
    pip_install "${group_args[@]}"
fi

if [ -z "$report_dir" ]; then
    # An editable install leaves the source uncompiled, and where PYTHONDONTWRITEBYTECODE is set
    # (this machine, many containers and CI images) every process compiles each module it imports
    # again: 0.2-0.4 s of CPU per process here, and the test suite starts over a thousand. Compile
    # once now, as a wheel install does (Python recompiles a module whose source changed since).
    dirs=(src)
    if [ "$group" = test ]; then dirs+=(tests examples benchmarks); fi
    "$PY" -m compileall -q -j 0 "${dirs[@]}" >/dev/null
    "$PY" -c "import slipstream, torch; print(f'slipstream {slipstream.__version__} installed (torch {torch.__version__})')"
fi
