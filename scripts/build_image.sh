#!/usr/bin/env bash
# Build the Slipstream training image with one command.
#
#   bash scripts/build_image.sh                        # CUDA base (the Dockerfile's BASE_IMAGE), torch from its CUDA index
#   bash scripts/build_image.sh --base IMAGE           # any base with apt (or with python3/venv already in it)
#   bash scripts/build_image.sh --local-base           # a Debian bookworm base made here by debootstrap (CPU), cached
#   options: --tag TAG            image name (default slipstream:VERSION, slipstream:VERSION-cpu with --local-base)
#            --torch-version V    (default 2.13.0)
#            --torch-index URL    wheel index for torch (default: the Dockerfile's CUDA index; the CPU index with --local-base)
#            --torch-wheels DIR   install torch from the wheels in DIR instead (no index)
#            --no-cache           rebuild every layer
#            --pin                re-resolve docker/constraints.txt (the pinned dependencies) and exit
#
# It stages a small build context (Dockerfile, the package, examples/, docker/), builds with
# the host's network (so a proxy the host uses works), and prints the image's size and the time
# the build took. The local base is made once (debootstrap, about a minute) and kept as an
# image and as a tarball in ${SLIPSTREAM_CACHE_DIR:-~/.cache/slipstream}; it carries the host's
# own CA certificates (/usr/local/share/ca-certificates), so pip inside the build trusts what the
# host trusts. Making it needs root and debootstrap.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "build_image: $*" >&2; exit 2; }

version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
base="" local_base=0 tag="" torch_version="2.13.0" torch_index="" torch_wheels="" no_cache=() pin=0
while [ $# -gt 0 ]; do
    case "$1" in
        --base) [ $# -ge 2 ] || die "--base needs an image"; base="$2"; shift 2 ;;
        --local-base) local_base=1; shift ;;
        --tag) [ $# -ge 2 ] || die "--tag needs a name"; tag="$2"; shift 2 ;;
        --torch-version) [ $# -ge 2 ] || die "--torch-version needs a version"; torch_version="$2"; shift 2 ;;
        --torch-index) [ $# -ge 2 ] || die "--torch-index needs a URL"; torch_index="$2"; shift 2 ;;
        --torch-wheels) [ $# -ge 2 ] || die "--torch-wheels needs a directory"; torch_wheels="$2"; shift 2 ;;
        --no-cache) no_cache=(--no-cache); shift ;;
        --pin) pin=1; shift ;;
        -h|--help) usage ;;
        *) echo "build_image: unknown option $1" >&2; usage ;;
    esac
done

if [ "$pin" = 1 ]; then
    report="$(mktemp)"; tc="$(mktemp)"
    trap 'rm -f "$report" "$tc"' EXIT
    echo "torch==$torch_version" >"$tc"
    "$PY" -m pip install -q --dry-run --ignore-installed --report "$report" ".[job,data]" -c "$tc"
    {
        echo "# Pinned versions of everything the image installs besides torch (Dockerfile, build stage)."
        echo "# Regenerate after a dependency change: bash scripts/build_image.sh --pin"
        "$PY" - "$report" <<'EOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
for name, ver in sorted((i["metadata"]["name"].lower().replace("_", "-"), i["metadata"]["version"]) for i in items):
    if name not in ("slipstream", "torch"):
        print(f"{name}=={ver}")
EOF
    } >docker/constraints.txt
    echo "build_image: wrote docker/constraints.txt ($(grep -vc '^#' docker/constraints.txt) pins)"
    exit 0
fi

[ -n "$base" ] && [ "$local_base" = 1 ] && die "--base and --local-base exclude each other"
[ -n "$torch_index" ] && [ -n "$torch_wheels" ] && die "--torch-index and --torch-wheels exclude each other"
if [ -n "$torch_wheels" ]; then
    [ -d "$torch_wheels" ] || die "--torch-wheels: no such directory: $torch_wheels"
    compgen -G "$torch_wheels/torch-$torch_version*.whl" >/dev/null \
        || die "--torch-wheels: no torch-$torch_version*.whl in $torch_wheels"
fi
command -v docker >/dev/null 2>&1 || die "no docker command; install Docker (Debian: apt-get install docker.io)"
if ! err="$(docker info 2>&1 >/dev/null)"; then
    die "no Docker engine reachable ($(printf '%s' "$err" | tail -1)); start one: bash scripts/docker_engine.sh start"
fi

LOCAL_BASE_TAG="slipstream-local-base:bookworm"
cache_dir="${SLIPSTREAM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/slipstream}"

make_local_base() {  # a minimal Debian with what the Dockerfile's system stage needs, as an image
    if docker image inspect "$LOCAL_BASE_TAG" >/dev/null 2>&1; then
        echo "build_image: local base $LOCAL_BASE_TAG (cached image)"
        return
    fi
    local tarball="$cache_dir/debian-bookworm-base.tar"
    if [ ! -s "$tarball" ]; then
        [ "$(id -u)" = 0 ] || die "--local-base: making the base needs root (debootstrap)"
        command -v debootstrap >/dev/null 2>&1 || die "--local-base needs debootstrap (Debian: apt-get install debootstrap)"
        local t0=$SECONDS root
        root="$(mktemp -d "${TMPDIR:-/tmp}/slipstream-base.XXXXXX")"
        echo "build_image: making the local base with debootstrap (about a minute)..."
        if ! debootstrap --variant=minbase \
                --include=python3,python3-venv,ca-certificates,libibverbs1,ibverbs-providers,iproute2,passwd \
                bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$root.log" 2>&1; then
            tail -5 "$root.log" >&2; rm -rf "$root" "$root.log"; die "debootstrap failed (log above)"
        fi
        # The host's own CAs (a proxy's, say), so pip in the build trusts what the host trusts.
        if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
            cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
            chroot "$root" update-ca-certificates >/dev/null 2>&1
        fi
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root.log"
        mkdir -p "$cache_dir"
        tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
        rm -rf "$root"
        echo "build_image: local base made in $((SECONDS - t0)) s, cached in $tarball"
    fi
    docker import "$tarball" "$LOCAL_BASE_TAG" >/dev/null
    echo "build_image: local base $LOCAL_BASE_TAG (imported from $tarball)"
}

t_start=$SECONDS
if [ "$local_base" = 1 ]; then
    make_local_base
    base="$LOCAL_BASE_TAG"
    tag="${tag:-slipstream:$version-cpu}"
    torch_index="${torch_index:-https://download.pytorch.org/whl/cpu}"
else
    tag="${tag:-slipstream:$version}"
fi

# The staged context: what the Dockerfile copies and nothing else.
ctx="$(mktemp -d "${TMPDIR:-/tmp}/slipstream-image.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT
cp -r Dockerfile pyproject.toml README.md LICENSE src examples docker "$ctx/"
find "$ctx" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
if [ -n "$torch_wheels" ]; then
    cp "$torch_wheels"/torch-"$torch_version"*.whl "$ctx/docker/wheels/"
elif [ "$local_base" = 1 ]; then
    # The CPU wheel for the base's Python, through the host's pip (its index, find-links and cache):
    # a machine with the wheel on disk builds without reaching download.pytorch.org.
    pyver="$(docker run --rm --entrypoint python3 "$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    echo "build_image: torch $torch_version for Python $pyver through the host's pip ($torch_index and its find-links)"
    "$PY" -m pip download -q --retries 0 --no-deps --only-binary=:all: --python-version "$pyver" \
        --platform "manylinux_2_28_$(uname -m)" --index-url "$torch_index" "torch==$torch_version" \
        -d "$ctx/docker/wheels" 2> >(grep -v -e '^WARNING: Retrying' -e 'ignored: it is neither' >&2) \
        || die "no torch==$torch_version wheel for Python $pyver from $torch_index; pass --torch-wheels DIR"
fi

revision="$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
if [ -n "$(git status --porcelain -- src pyproject.toml Dockerfile docker examples 2>/dev/null)" ]; then
    revision="$revision-dirty"
fi
args=(--network host -t "$tag" --build-arg "TORCH_VERSION=$torch_version"
      --build-arg "VERSION=$version" --build-arg "REVISION=$revision")
[ -n "$base" ] && args+=(--build-arg "BASE_IMAGE=$base")
[ -n "$torch_index" ] && args+=(--build-arg "TORCH_INDEX=$torch_index")
echo "build_image: building $tag from ${base:-the default base of the Dockerfile}..."
t_build=$SECONDS
docker build "${no_cache[@]}" "${args[@]}" "$ctx"
size_bytes="$(docker image inspect -f '{{.Size}}' "$tag")"
echo "build_image: built $tag ($revision): $((size_bytes / 1000000)) MB, docker build $((SECONDS - t_build)) s, total $((SECONDS - t_start)) s"
