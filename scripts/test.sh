#!/usr/bin/env bash
# The test command: install, start real servers, lint, type-check, test, and
# stop the servers even when something fails. Servers use their own ports and
# folder, so a running development stack is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

scripts/bootstrap.sh --tests
source scripts/test_env.sh
# Engine speed, and so every duration below, depends on these (docs/testing.md).
cpu=$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | xargs || true)
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -x -E 'avx2|avx512f|avx512_bf16|amx_tile' | xargs || true)
echo "== machine: ${cpu:-unknown CPU}, $(nproc) cores, flags: ${flags:-none of avx2 avx512f avx512_bf16 amx_tile}"

# The servers start while the code is linted and type-checked (half a minute saved).
mkdir -p "$TANDOOR_HOME"
servers_log="$TANDOOR_HOME/infra-up.log"
echo "== servers starting ($(date +%T)), log in $servers_log"
tandoor infra up >"$servers_log" 2>&1 &
servers=$!
trap '{ kill "$servers" 2>/dev/null && wait "$servers"; } || true; echo "== stopping servers"; tandoor infra down' EXIT

echo "== ruff ($(date +%T))"
ruff check .
ruff format --check .
echo "== mypy ($(date +%T))"
mypy

echo "== servers ($(date +%T))"
if ! wait "$servers"; then
    cat "$servers_log"; echo "the servers did not start"; exit 1
fi
cat "$servers_log"

echo "== pytest ($(date +%T))"
# In the background, so that a TERM or INT to this script (a cancelled CI job, `kill`)
# reaches pytest first: it stops the workers and gateways its tests started (each in its
# own session) before the servers stop. Killed with the script, it ran on against none.
pytest --durations=25 "$@" &
tests=$!
trap 'kill -TERM "$tests" 2>/dev/null || true' TERM INT
status=0
wait "$tests" || status=$?
while kill -0 "$tests" 2>/dev/null; do  # a trapped signal ends the wait, not pytest
    wait "$tests" || status=$?
done
[ "$status" -eq 0 ] || exit "$status"
echo "test command finished in $(( $(date +%s) - start )) s"
