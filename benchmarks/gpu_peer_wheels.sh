#!/usr/bin/env bash
# Puts the NIXL wheel that `benchmarks/peers.py --device cuda` needs on the GPU host into
# .whl/ (next to the wheels .ci/gpu installs there): nixl-cu13 1.5.1 for Python 3.12, the
# GPU host's CUDA 13. The GPU host has no network, so the wheel is fetched here and carried.
# Its nixl_ep_cu13/ (expert-parallel kernels, three torch builds, ~27 MiB compressed) is
# left out: peers.py does not use it, and the carried files must stay under 64 MiB.
#   bash benchmarks/gpu_peer_wheels.sh [DIR]   (DIR defaults to .whl)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$repo/.whl}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 nixl-cu13==1.5.1 -d "$tmp"
mkdir -p "$dir"
python3 - "$tmp" "$dir" <<'PY'
import glob, os, sys, zipfile
src = glob.glob(os.path.join(sys.argv[1], "nixl_cu13-*.whl"))[0]
dst = os.path.join(sys.argv[2], os.path.basename(src))
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
    for info in zi.infolist():
        if info.filename.startswith("nixl_ep_cu13/"):
            continue
        data = zi.read(info)
        if info.filename.endswith(".dist-info/RECORD"):  # keep RECORD true to the files
            data = b"\n".join(line for line in data.split(b"\n")
                              if not line.startswith(b"nixl_ep_cu13/"))
        zo.writestr(info, data)
print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB")
PY
