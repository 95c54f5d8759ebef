#!/usr/bin/env bash
# GPU check, on a machine with one CUDA GPU and no network:
#  1. the LM-head latency claim (issue 5): time the full, low-rank (r = d/8 and d/16) and trimmed (32k rows)
#     heads at the paper's three target shapes (Llama-3.1-8B d 4096 V 128256; gpt-oss-20b d 2880 V 201088;
#     Qwen3-30B-A3B d 2048 V 151936), batch 1 and 64, bf16, timed with CUDA events (median of interleaved
#     rounds after warm-up), and print the table (< 5 minutes);
#  2. the pipeline on the GPU (issue 16): convert the committed SmolLM2 demo drafter (calibration pass on the
#     GPU), a short head fine-tune on the GPU, then greedy generate on the GPU: float32 speculative output must
#     equal float32 plain decoding token for token; the bf16 default run reports tau and tokens/s. Needs the
#     SmolLM2 target folder (TARGET=folder, or the cache `slimspec fetch-smollm2` fills); skipped without it.
#
# Usage (from anywhere):  examples/gpu_check.sh [extra `slimspec bench head` options]
#   OUT=dir      where gpu_check.json and gpu_check_run/ go (default: current folder)
#   PYTHON=exe   interpreter with the package importable (default: python)
#   DEVICE=cpu   smoke-test the script without a GPU (use with e.g. --hidden-size 64 --vocab-size 512)
#   TARGET=dir   SmolLM2-135M-Instruct folder for step 2 (default: the slimspec cache)
#   FT_STEPS=20 GEN_TOKENS=48 GEN_PROMPTS=3   size of step 2
set -euo pipefail
OUT="${OUT:-$PWD}"
PY="${PYTHON:-python}"
DEVICE="${DEVICE:-cuda}"
FT_STEPS="${FT_STEPS:-20}"
GEN_TOKENS="${GEN_TOKENS:-48}"
GEN_PROMPTS="${GEN_PROMPTS:-3}"
cd "$(dirname "$0")/.."
SLIMSPEC=("$PY" -c 'from slimspec_convert.cli import main; main()')
if [ "$DEVICE" = cuda ]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: this check needs a GPU")'
  "$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
fi
timeout 280 "${SLIMSPEC[@]}" bench head \
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
busy = {r["machine"]["reason"] for r in rows if r.get("machine", {}).get("busy")}
print("machine: " + ("BUSY: " + "; ".join(sorted(busy)) if busy else "quiet (load average and timing spread)"))
PYEOF

TARGET="${TARGET:-$("$PY" -c 'from slimspec_convert.targets.fetch import SMOLLM2_DIR_NAME, cache_dir; print(cache_dir() / SMOLLM2_DIR_NAME)')}"
if [ ! -f "$TARGET/config.json" ]; then
  echo "pipeline check skipped: no SmolLM2 target at $TARGET (set TARGET=folder, or run slimspec fetch-smollm2 once)"
  exit 0
fi
RUN="$OUT/gpu_check_run"
mkdir -p "$RUN"
echo "== convert (calibrated on the built-in training slice) on $DEVICE"
timeout 300 "${SLIMSPEC[@]}" convert drafters/smollm2-135m-eagle3 "$RUN/r72" --target "$TARGET" --device "$DEVICE" \
  --force --json > "$RUN/convert.json"
echo "== fine-tune ($FT_STEPS steps, head only) on $DEVICE"
timeout 300 "${SLIMSPEC[@]}" finetune --target "$TARGET" --drafter "$RUN/r72" --data data/train/gsm8k/train.jsonl \
  --data data/train/gpteacher/codegen-instruct.json --out "$RUN/ft" --steps "$FT_STEPS" --lr 5e-4 --ttt-steps 3 \
  --batch-size 4 --max-length 256 --eval-every "$FT_STEPS" --eval-batches 2 --save-every "$FT_STEPS" \
  --warmup-steps 2 --device "$DEVICE" --force --json > "$RUN/finetune.json"
echo "== generate on $DEVICE (greedy; float32 for the token-for-token check, then the default dtype)"
GEN=(--target "$TARGET" --prompts examples/demo_prompts.jsonl --limit "$GEN_PROMPTS" --max-new-tokens "$GEN_TOKENS"
     --device "$DEVICE" --json)
timeout 300 "${SLIMSPEC[@]}" generate "${GEN[@]}" --drafter none --dtype float32 > "$RUN/plain_fp32.json"
timeout 300 "${SLIMSPEC[@]}" generate "${GEN[@]}" --drafter "$RUN/ft" --dtype float32 > "$RUN/spec_fp32.json"
timeout 300 "${SLIMSPEC[@]}" generate "${GEN[@]}" --drafter none > "$RUN/plain_auto.json"
timeout 300 "${SLIMSPEC[@]}" generate "${GEN[@]}" --drafter "$RUN/ft" --rerank 64 > "$RUN/spec_auto.json"
"$PY" - "$RUN" <<'PYEOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
load = lambda name: json.loads((run / name).read_text())
conv, ft = load("convert.json"), load("finetune.json")
cal = conv["calibration"]
print(f"convert: r={conv['rank']}, logit error {cal['logit_relative_error']:.4f} calibrated vs "
      f"{cal['svd_logit_relative_error']:.4f} plain SVD ({cal['rows']} hidden states), {conv['seconds']:.1f} s")
print(f"finetune: {ft['steps']} steps, held-out score {ft['before']['score']:.4f} -> {ft['history'][-1]['score']:.4f}, "
      f"{ft['tokens_per_s']:.0f} training tokens/s, {ft['seconds']:.0f} s")
same = [a["output_ids"] == b["output_ids"] for a, b in zip(load("plain_fp32.json"), load("spec_fp32.json"))]
print(f"generate float32: speculative == plain on {sum(same)}/{len(same)} prompts (lossless: {all(same)})")
for name in ("plain_auto.json", "spec_auto.json"):
    rows = load(name)
    toks = sum(r["stats"]["new_tokens"] for r in rows)
    wall = sum(r["stats"]["wall_ms"] for r in rows) / 1e3
    taus = [r["stats"]["tau"] for r in rows if r["stats"]["tau"] is not None]
    print(f"generate default dtype, {name[:-5]}: {toks / wall:.1f} tokens/s, "
          f"tau (accepted drafts + 1 bonus per verification) {sum(taus) / max(len(taus), 1):.3f}")
sys.exit(0 if all(same) else "greedy speculative output differs from plain decoding in float32")
PYEOF
