#!/usr/bin/env bash
# Create .venv (once) with alpa-lite and everything its tests need, at the tested versions.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import alpa_lite, torch, pulp, highspy, numpy, rich, transformers, matplotlib, pytest, xdist, networkx" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/pip install -q -c constraints.txt -e ".[dev]"
fi
