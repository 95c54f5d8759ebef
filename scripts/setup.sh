#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with SlimSpec and its test tools.
# torch==2.13.0 is installed first: on CPU-only machines that pin takes the CPU wheel (an unpinned
# `torch` in a fresh venv would pull a multi-GB CUDA build). On a GPU machine install the torch
# build you need first; pyproject accepts torch>=2.4,<2.14.
# Usage: source scripts/setup.sh   (activates .venv in the calling shell)
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ ! -x "$_root/.venv/bin/python" ]; then
  python3 -m venv "$_root/.venv"
fi
# shellcheck disable=SC1091
. "$_root/.venv/bin/activate"
if ! python -c "import torch, slimspec_convert, pytest" >/dev/null 2>&1; then
  pip install --quiet torch==2.13.0
  pip install --quiet -e "$_root[dev]"
fi
