#!/usr/bin/env bash
# GPU check of the LM-head latency claim (issue 5): on a machine with one CUDA GPU and no network, time the full,
# low-rank (r = d/8 and d/16) and trimmed (32k rows) heads at the paper's three target shapes
# (Llama-3.1-8B d 4096 V 128256; gpt-oss-20b d 2880 V 201088; Qwen3-30B-A3B d 2048 V 151936), batch 1 and 64,
# bf16, timed with CUDA events (median of interleaved rounds after warm-up), and print the table. < 5 minutes.
#
# Usage (from anywhere):  examples/gpu_check.sh [extra `slimspec bench head` options]
#   OUT=dir      where gpu_check.json goes (default: current folder)
#   PYTHON=exe   interpreter with the package importable (default: python)
#   DEVICE=cpu   smoke-test the script without a GPU (use with e.g. --hidden-size 64 --vocab-size 512)
set -euo pipefail
OUT="${OUT:-$PWD}"
PY="${PYTHON:-python}"
DEVICE="${DEVICE:-cuda}"
cd "$(dirname "$0")/.."
if [ "$DEVICE" = cuda ]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: this check needs a GPU")'
  "$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
fi
timeout 280 "$PY" -c 'from slimspec_convert.cli import main; main()' bench head \
  --batch-sizes 1,64 --dtype bf16 --device "$DEVICE" --warmup 5 --repeats 50 --budget-s 5 --json "$@" \
  > "$OUT/gpu_check.json"
"$PY" - "$OUT/gpu_check.json" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))
print(f"{'d':>5} {'V':>7} {'r':>4} {'B':>3} {'dtype':>8} {'full ms':>9} {'low ms':>8} {'speedup':>8} {'ideal':>7} "
      f"{'matmul':>7} {'mod/bare':>8} {'trim ms':>8} {'rounds':>6}")
for r in rows:
    trimmed = "-" if r["trimmed_ms"] is None else f"{r['trimmed_ms']:.4f}"
    print(f"{r['hidden_size']:>5} {r['vocab_size']:>7} {r['rank']:>4} {r['batch_size']:>3} {r['dtype']:>8} "
          f"{r['full_ms']:>9.4f} {r['lowrank_ms']:>8.4f} {r['speedup']:>7.2f}x {r['ideal_speedup']:>6.2f}x "
          f"{r['matmul_speedup']:>6.2f}x {r['lowrank_overhead']:>8.3f} {trimmed:>8} {r['repeats']:>6}")
print(f"{len(rows)} rows on {rows[0]['device']}; JSON in {sys.argv[1]}")
PYEOF
