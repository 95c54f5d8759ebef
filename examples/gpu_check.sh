#!/usr/bin/env bash
# GPU check of the LM-head latency claim (issue 5): on a machine with one CUDA GPU and no network, time the full,
# low-rank (r = d/8 and d/16) and trimmed (32k rows) heads at the paper's three target shapes
# (Llama-3.1-8B d 4096 V 128256; gpt-oss-20b d 2880 V 201088; Qwen3-30B-A3B d 2048 V 151936), batch 1 and 64,
# bf16, with CUDA events (median of interleaved rounds after warm-up), and print the table. Takes < 5 minutes.
#
# Usage: examples/gpu_check.sh [extra `slimspec bench head` options]     (run from the repository root)
# Needs: the package installed (`pip install -e .`) or importable from this checkout; writes nothing but
# gpu_check.json in $OUT (default: the current folder).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.}"
PY="${PYTHON:-python}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: this check needs a GPU")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
run() { timeout 280 "$PY" -c 'from slimspec_convert.cli import main; main()' bench head \
  --batch-sizes 1,64 --dtype bf16 --device cuda --warmup 5 --repeats 50 --budget-s 5 "$@"; }
run --json "$@" > "$OUT/gpu_check.json"
"$PY" - "$OUT/gpu_check.json" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))
print(f"{'d':>5} {'V':>7} {'r':>4} {'B':>3} {'full ms':>9} {'low ms':>8} {'speedup':>8} {'ideal':>6} "
      f"{'matmul':>7} {'mod/bare':>8} {'trim32k ms':>10}")
for r in rows:
    print(f"{r['hidden_size']:>5} {r['vocab_size']:>7} {r['rank']:>4} {r['batch_size']:>3} {r['full_ms']:>9.4f} "
          f"{r['lowrank_ms']:>8.4f} {r['speedup']:>7.2f}x {r['ideal_speedup']:>5.2f}x {r['matmul_speedup']:>6.2f}x "
          f"{r['lowrank_overhead']:>8.3f} {r['trimmed_ms'] if r['trimmed_ms'] is None else round(r['trimmed_ms'], 4):>10}")
print(f"rows written to {sys.argv[1]}")
PYEOF
