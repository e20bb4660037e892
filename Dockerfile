# kvd — KV-cache transfer daemon, one container per node.
#
# CPU build (default; small, runs the TCP data plane and CPU tensors in shared memory):
#   docker build -t kvd .
# GPU build: a CUDA torch wheel (it brings its own CUDA runtime libraries; the host needs the
# NVIDIA driver and the NVIDIA Container Toolkit) and the gpu extra (NCCL bindings):
#   docker build -t kvd:cuda \
#     --build-arg TORCH_SPEC="--index-url https://download.pytorch.org/whl/cu126 torch" \
#     --build-arg KVD_EXTRAS="[gpu]" .
# Pin the torch version your inference containers run (e.g. "... torch==2.13.0").
#
# Run flags for a GPU node (--gpus, --ipc=host, --pid=host, --ulimit memlock=-1, ...) and
# how the inference containers reach the socket: docs/operations.md, "Running in a container".

FROM python:3.11-slim

# Where torch comes from: pip arguments, word-split on purpose. The default is the CPU wheel
# index (PyPI's Linux torch is the multi-GB CUDA build).
ARG TORCH_SPEC="--index-url https://download.pytorch.org/whl/cpu torch"
# Optional extras of the kvd package, e.g. "[gpu]".
ARG KVD_EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    KVD_SOCKET_PATH=/run/kvd/kvd.sock

# Same uid/gid as the host's `kvd` user and group should have (docs/operations.md): the
# socket and its directory are owned by it, and inference processes join gid 10001.
RUN groupadd --system --gid 10001 kvd \
    && useradd --system --uid 10001 --gid kvd --create-home --home-dir /home/kvd \
       --shell /usr/sbin/nologin kvd \
    && install -d -m 0750 -o kvd -g kvd /run/kvd \
    && install -d -m 0750 -o root -g kvd /etc/kvd

# torch first (from TORCH_SPEC), so that installing kvd finds it and takes nothing from PyPI's
# CUDA build.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_SPEC}

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvd ./kvd
RUN pip install --no-cache-dir ".${KVD_EXTRAS}" \
    && rm -rf /src \
    && kvd --version

WORKDIR /home/kvd
USER kvd:kvd

# The config file (kvd.toml, the node's CurveZMQ key pair, the allow-list), mounted
# read-only from the host.
VOLUME /etc/kvd

# peer_port (control), data_port (TCP bytes), http_port (metrics, health, status).
EXPOSE 14579 14580 9400

# Liveness: /healthz answers as soon as the HTTP listener is up (before the pool is
# allocated). Needs http_host to include 127.0.0.1 (127.0.0.1 or 0.0.0.0); follows
# KVD_HTTP_PORT if that is how the port was changed. No curl in slim images: urllib.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('KVD_HTTP_PORT', '9400'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4).status == 200 else 1)"]

# SIGTERM drains (finish in-flight transfers within drain_grace_s, 30 s by default): run with
# `--stop-timeout 45` or docker kills the daemon after 10 s.
STOPSIGNAL SIGTERM

ENTRYPOINT ["kvd", "serve"]
CMD ["--config", "/etc/kvd/kvd.toml"]
