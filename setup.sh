#!/usr/bin/env bash
# Create .venv in the repo root and install the pinned stack (requirements.txt).
# Idempotent: a second run with unchanged requirements does nothing.
#   bash setup.sh --peer   also requirements-peer.txt (TRL and Liger, for bench/peer.py only)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat .venv/.requirements.sha 2>/dev/null)" != "$want" ]; then
  echo "setup: installing requirements into .venv (first time: several minutes, ~8 GB) ..." >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > .venv/.requirements.sha
fi
if [ "${1:-}" = "--peer" ]; then
  want=$(sha256sum requirements.txt requirements-peer.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat .venv/.requirements-peer.sha 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q -r requirements-peer.txt
    echo "$want" > .venv/.requirements-peer.sha
  fi
fi
