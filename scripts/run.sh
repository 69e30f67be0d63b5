#!/usr/bin/env bash
# The main job: install what is missing, then run the whole local stack in the
# foreground. Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/tandoor run "$@"
