# kvd — KV-cache transfer daemon, one container per node.
#
# CPU build (default; small, runs the TCP data plane and CPU tensors in shared memory):
#   docker build -t kvd .
# GPU build: a CUDA torch wheel (it brings its own CUDA runtime libraries; the host needs the
# NVIDIA driver and the NVIDIA Container Toolkit) and the gpu extra (NCCL bindings):
#   docker build -t kvd:cuda \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     --build-arg KVD_EXTRAS="[gpu]" .
# TORCH_VERSION (2.13.0, the version CI tests) should be the one your inference containers
# run; TORCH_INDEX the wheel index of their CUDA build.
#
# Run flags for a GPU node (--gpus, --ipc=host, --pid=host, --ulimit memlock=-1,
# --ulimit nofile=65536, ...) and
# how the inference containers reach the socket: docs/operations.md, "Running in a container".

# A precise tag (Python 3.11.16 on Debian trixie). To pin the bytes too, append the digest
# your registry reports for it (`docker buildx imagetools inspect python:3.11.16-slim-trixie`)
# as "@sha256:...".
FROM python:3.11.16-slim-trixie

# Where torch comes from: the CPU wheel index by default (PyPI's Linux torch is the
# multi-GB CUDA build).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Optional extras of the kvd package, e.g. "[gpu]".
ARG KVD_EXTRAS=""

# KVD_CONFIG names the config file, for the daemon and for the HEALTHCHECK alike: choose
# another with `-e KVD_CONFIG=...`, change single settings with `-e KVD_<KEY>=...`.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    KVD_CONFIG=/etc/kvd/kvd.toml \
    KVD_SOCKET_PATH=/run/kvd/kvd.sock

# Same uid/gid as the host's `kvd` user and group should have (docs/operations.md): the
# socket and its directory are owned by it, and inference processes join gid 10001.
RUN groupadd --system --gid 10001 kvd \
    && useradd --system --uid 10001 --gid kvd --create-home --home-dir /home/kvd \
       --shell /usr/sbin/nologin kvd \
    && install -d -m 0750 -o kvd -g kvd /run/kvd \
    && install -d -m 0750 -o root -g kvd /etc/kvd

# The built-in config, used when nothing is mounted over /etc/kvd: a daemon on this node
# only (peer ports on loopback, no keys), HTTP on every interface of the container so that
# `-p 9400:9400` reaches /metrics. Mount your own /etc/kvd (kvd.toml, keys) for a cluster.
RUN printf '%s\n' \
      '# The kvd image default config (replaced by a mounted /etc/kvd).' \
      '# Peers: on loopback only, no keys; a node in a cluster needs its own config.' \
      'peer_host = "127.0.0.1"' \
      'peer_port = 14579' \
      'data_port = 14580' \
      'http_host = "0.0.0.0"' \
      'http_port = 9400' \
      'pool_size_bytes = "1GiB"' \
      'log_level = "info"' \
      > /etc/kvd/kvd.toml \
    && chown root:kvd /etc/kvd/kvd.toml \
    && chmod 0640 /etc/kvd/kvd.toml

# torch first, so that installing kvd finds it and takes nothing from PyPI's CUDA build.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvd ./kvd
# (DL3013: "." is this source tree; its dependencies take pyproject.toml's ranges.)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".${KVD_EXTRAS}" \
    && rm -rf /src \
    && kvd --version

WORKDIR /home/kvd
USER 10001:10001

# The config file (kvd.toml, the node's CurveZMQ key pair, the allow-list), mounted
# read-only from the host; without it, the built-in one above.
VOLUME /etc/kvd

# peer_port (control), data_port (TCP bytes), http_port (metrics, health, status).
EXPOSE 14579 14580 9400

# Liveness: /healthz answers as soon as the HTTP listener is up (before the pool is
# allocated). The address is the config's, read as `kvd serve` reads it (KVD_CONFIG, then
# KVD_* variables); 0.0.0.0 or :: is reached on loopback. Settings given as flags after the
# image name are not seen here: move http_host/http_port in the file or with -e.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; from kvd.config import load_config; c = load_config(env=os.environ, check_paths=False); h = {'0.0.0.0': '127.0.0.1', '::': '::1'}.get(c.http_host, c.http_host); h = f'[{h}]' if ':' in h else h; sys.exit(0 if urllib.request.urlopen(f'http://{h}:{c.http_port}/healthz', timeout=4).status == 200 else 1)"]

# SIGTERM drains (finish in-flight transfers within drain_grace_s, 30 s by default): run with
# `--stop-timeout 45` or docker kills the daemon after 10 s.
STOPSIGNAL SIGTERM

# `kvd serve` with the config KVD_CONFIG names; arguments after the image name are added
# (`docker run kvd --log-level debug`).
ENTRYPOINT ["kvd", "serve"]
CMD []
