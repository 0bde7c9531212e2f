# Slipstream training image: CUDA base, PyTorch, Slipstream (with the job and data extras).
#
# Build and push (see docs/job.md, "Container image"):
#   docker build -t REGISTRY/slipstream:0.1.0 .
#   docker push REGISTRY/slipstream:0.1.0
# Other CUDA / torch combinations:
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 -t REGISTRY/slipstream:0.1.0-cu130 .
#
# Pods rendered by `slipstream render` run `slipstream run ... SCRIPT` in WORKDIR
# /workspace, so relative script paths in a job spec resolve there. Add your own
# code with a two-line Dockerfile:  FROM REGISTRY/slipstream:0.1.0  +  COPY . /workspace

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# python3 for the venv; ibverbs so NCCL can use RDMA NICs (network.rdma_resource);
# iproute2 for the emulated cluster (slipstream run --emulate, needs CAP_NET_ADMIN).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates libibverbs1 ibverbs-providers iproute2 \
 && rm -rf /var/lib/apt/lists/*

# torch first and on its own layer: it is the big one and changes least often.
RUN python3 -m venv ${VIRTUAL_ENV} \
 && pip install --upgrade pip \
 && pip install --index-url ${TORCH_INDEX} "torch==${TORCH_VERSION}"

# Only what the package build needs, so edits elsewhere in the repo keep the cache.
COPY pyproject.toml README.md /opt/slipstream-src/
COPY src /opt/slipstream-src/src
# The torch installed above stays: pip may not replace it while resolving the extras.
RUN pip freeze | grep -i '^torch==' > /opt/torch-constraint.txt \
 && pip install -c /opt/torch-constraint.txt "/opt/slipstream-src[job,data]" \
 && slipstream --version

WORKDIR /workspace
COPY examples /workspace/examples

# Not root. (Ubuntu 24.04 images already use uid 1000 for 'ubuntu'.)
RUN useradd --create-home --uid 10001 slipstream && chown -R slipstream /workspace
USER 10001

# c10d rendezvous store on replica 0 (RDZV_PORT in slipstream/job/spec.py).
EXPOSE 29400

CMD ["slipstream", "--help"]
