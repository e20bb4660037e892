#!/usr/bin/env bash
# Builds the virtualenv that benchmarks/peers.py runs in: kvd (editable, from this checkout)
# on the CPU build of torch 2.13.0, plus the systems it is measured against, which are not
# kvd's dependencies:
#
#   NIXL        nixl-cu12==1.5.1 (its wheel bundles UCX; the CPU path needs no GPU)
#   Mooncake TE mooncake-transfer-engine-non-cuda==0.3.13.post1 (needs libibverbs1, an apt
#               package, even for its TCP transport: the engine links against it)
#
#   bash benchmarks/install_peers.sh [VENV_DIR]
#
# VENV_DIR defaults to $BENCH_PEERS_VENV, else .venv-peers in the repository. Idempotent: a
# system already installed is kept. Each competitor is installed on its own; one that cannot
# be installed (or imported afterwards) is reported with the reason, and peers.py skips it
# with that reason (it reads VENV_DIR/peers-status.txt, one "name: ok|why" a line).
# The last line printed is the venv's python; the exit code is 0 when kvd itself installed,
# whatever happened to the competitors. pip's output is in VENV_DIR.log.
set -uo pipefail

TORCH_REQ="torch==2.13.0"   # the CPU wheel this machine's image keeps on disk
NIXL_REQ="nixl-cu12==1.5.1"
MOONCAKE_REQ="mooncake-transfer-engine-non-cuda==0.3.13.post1"
PYTHON="${BENCH_PEERS_PYTHON:-python3.11}"

repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-${BENCH_PEERS_VENV:-$repo/.venv-peers}}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
log="$venv.log"
py="$venv/bin/python"
status="$venv/peers-status.txt"
t_start=$SECONDS

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_PROGRESS_BAR=off

fail() {  # kvd itself could not be installed: nothing to benchmark
    echo "install_peers: $*" >&2
    [[ -s "$log" ]] && { echo "---- last lines of $log ----" >&2; tail -n 15 "$log" >&2; }
    exit 1
}

step() {  # step "what" command...: output to the log, its time printed
    local what="$1" t0=$SECONDS
    shift
    echo "== $what" >>"$log"
    if ! "$@" >>"$log" 2>&1; then
        echo "install_peers: $what failed after $((SECONDS - t0)) s" >&2
        return 1
    fi
    echo "install_peers: $what ($((SECONDS - t0)) s)"
}

imports() {  # imports MODULE: whether the venv's python imports it (run from /: not this kvd/)
    (cd / && "$py" -c "import $1") >>"$log" 2>&1
}

record() {  # record NAME STATUS: one line of the status file peers.py reads
    grep -v "^$1: " "$status" 2>/dev/null >"$status.tmp"
    echo "$1: $2" >>"$status.tmp"
    mv "$status.tmp" "$status"
    echo "install_peers: $1: $2"
}

[[ "$(uname -s)" == Linux ]] || fail "the peers' wheels are for Linux, this is $(uname -s)"
command -v "$PYTHON" >/dev/null 2>&1 || fail "no $PYTHON here (the torch CPU wheel on disk is for 3.11)"

mkdir -p "$(dirname "$venv")"
: >"$log"
if [[ ! -x "$py" ]]; then
    if [[ -e "$venv" ]]; then
        [[ -f "$venv/pyvenv.cfg" ]] || fail "$venv exists and is not a virtualenv; not touching it"
        rm -rf "$venv"
    fi
    step "create venv with $PYTHON" "$PYTHON" -m venv "$venv" || fail "$PYTHON -m venv failed"
    step "upgrade pip" "$py" -m pip install --quiet --upgrade pip || fail "pip could not be upgraded (no package index?)"
fi
if ! imports torch; then
    step "pip install $TORCH_REQ" "$py" -m pip install --quiet "$TORCH_REQ" \
        || fail "$TORCH_REQ did not install (this machine's image provides the CPU wheel)"
fi
if [[ "$( (cd / && "$py" -c 'import kvd; print(kvd.__file__)') 2>/dev/null)" != "$repo/kvd/"* ]]; then
    step "pip install -e kvd" "$py" -m pip install --quiet -e "$repo" || fail "kvd did not install"
fi

# NIXL: a wheel with UCX inside; it imports without CUDA. nixl-cu12 installs the module
# nixl_cu12 (the 'nixl' name belongs to a meta-package that picks a CUDA major).
if imports nixl_cu12._api; then
    record nixl ok
elif step "pip install $NIXL_REQ" "$py" -m pip install --quiet "$NIXL_REQ"; then
    if imports nixl_cu12._api; then
        record nixl ok
    else
        record nixl "$NIXL_REQ installed but 'import nixl_cu12._api' fails (see $log)"
    fi
else
    record nixl "pip could not install $NIXL_REQ (see $log)"
fi

# Mooncake TE: its engine links libibverbs even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    if command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
        export DEBIAN_FRONTEND=noninteractive
        step "apt-get install libibverbs1" bash -c \
            'apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1' || true
    fi
fi
if imports mooncake.engine; then
    record mooncake ok
elif step "pip install $MOONCAKE_REQ" "$py" -m pip install --quiet "$MOONCAKE_REQ"; then
    if imports mooncake.engine; then
        record mooncake ok
    elif ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
        record mooncake "libibverbs1 is missing (apt-get install libibverbs1, as root) and $MOONCAKE_REQ needs it"
    else
        record mooncake "$MOONCAKE_REQ installed but 'import mooncake.engine' fails (see $log)"
    fi
else
    record mooncake "pip could not install $MOONCAKE_REQ (see $log)"
fi

echo "install_peers: $(du -sh "$venv" 2>/dev/null | cut -f1) in $venv, $((SECONDS - t_start)) s"
echo "$py"
