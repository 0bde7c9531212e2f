# Slipstream training image: a base with Python 3, PyTorch, Slipstream (job and data extras).
#
# Build it with one command (see docs/job.md, "Container image"):
#   bash scripts/build_image.sh                     # CUDA base (BASE_IMAGE below), torch from TORCH_INDEX
#   bash scripts/build_image.sh --local-base        # CPU: a Debian base made here with debootstrap
# The script stages a small build context (this file, the package, examples/, docker/) and
# prints the image's size and the build time. A plain `docker build .` from the repository
# root works too.
#
# Pods rendered by `slipstream render` run `slipstream run ... SCRIPT` in WORKDIR /workspace,
# so relative script paths in a job spec resolve there. Add your own code with:
#   FROM REGISTRY/slipstream:0.1.0
#   COPY . /workspace

ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# --- system: what both stages share (the venv's python is this stage's /usr/bin/python3) ---
FROM ${BASE_IMAGE} AS system
# python3 and venv; ibverbs so NCCL can use RDMA NICs (network.rdma_resource); iproute2 for the
# emulated cluster (slipstream run --emulate, needs CAP_NET_ADMIN); passwd for useradd.
# A base that has them all (the local base) skips apt, so its build needs no Debian mirror.
RUN set -eu; \
    pkgs="python3 python3-venv ca-certificates libibverbs1 ibverbs-providers iproute2 passwd"; \
    if ! dpkg -s $pkgs >/dev/null 2>&1; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs; \
        rm -rf /var/lib/apt/lists/*; \
    fi

# --- deps: torch and every pinned dependency in a venv, in a stage of its own so wheels and
# pip's work never reach the image. It changes only with docker/ (pins, wheels) or the base.
FROM system AS deps
ARG TORCH_VERSION=2.13.0
# Where torch comes from: a wheel in docker/wheels/ if there is one (scripts/build_image.sh
# --torch-wheels DIR puts it there), else this index.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
COPY docker/constraints.txt /tmp/constraints.txt
COPY docker/wheels/ /tmp/wheels/
RUN set -eu; \
    python3 -m venv /opt/venv; \
    wheel="$(ls /tmp/wheels/torch-"${TORCH_VERSION}"*.whl 2>/dev/null | head -1)"; \
    if [ -n "$wheel" ]; then \
        /opt/venv/bin/pip install -c /tmp/constraints.txt "$wheel"; \
    else \
        /opt/venv/bin/pip install -c /tmp/constraints.txt --index-url "${TORCH_INDEX}" \
            --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}"; \
    fi; \
    /opt/venv/bin/pip list --format=freeze | grep -i '^torch==' > /tmp/torch.txt; \
    /opt/venv/bin/pip install -c /tmp/torch.txt -r /tmp/constraints.txt

# --- package: Slipstream's own wheel (small; the only layer a source change rebuilds) ---
FROM deps AS package
COPY pyproject.toml README.md LICENSE /tmp/slipstream-src/
COPY src /tmp/slipstream-src/src
RUN /opt/venv/bin/pip wheel --no-deps --no-build-isolation -w /tmp/dist /tmp/slipstream-src

# --- the image ---
FROM system
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=https://github.com/slipstream-ml/slipstream
LABEL org.opencontainers.image.title="slipstream" \
      org.opencontainers.image.description="Distributed deep-learning training engine on PyTorch" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=deps /opt/venv /opt/venv
# `pip check`: a dependency pyproject.toml names but docker/constraints.txt lacks fails the build
# here (then: bash scripts/build_image.sh --pin).
COPY --from=package /tmp/dist /tmp/dist
RUN PIP_ROOT_USER_ACTION=ignore pip install --no-index --no-deps /tmp/dist/*.whl && rm -rf /tmp/dist \
 && pip check && slipstream --version

WORKDIR /workspace
COPY examples /workspace/examples
# Not root. (Ubuntu 24.04 images already use uid 1000 for 'ubuntu'.)
RUN useradd --create-home --uid 10001 slipstream && chown -R slipstream /workspace
USER 10001

# c10d rendezvous store on replica 0 (RDZV_PORT in slipstream/job/spec.py).
EXPOSE 29400

# `docker run IMAGE run -n 2 train.py`; pods set their own command (slipstream run ...).
ENTRYPOINT ["slipstream"]
CMD ["--help"]
