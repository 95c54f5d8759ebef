#!/usr/bin/env bash
# Per-kind benchmark of the defaults a user gets: for each kind of prompt (writing, qa, math, code,
# translation, summarisation; data/eval/kinds/<kind>.jsonl, built by examples/make_kind_prompts.py),
# one interleaved `slimspec bench e2e` with
#   - plain decoding (always run),
#   - full: the committed demo drafter with no draft flags (--draft auto plans its shape and prompt
#     lookup on held-out training prompts, never on these),
#   - full-lookup3: the same drafter with the main job's former hand-set --lookup 3 (shape planned),
#   - slimspec: its SlimSpec conversion (r = 72), when SLIMSPEC names a converted folder,
# greedy, the fastest of REPEATS runs per prompt. Writes results/smollm2/kinds/<kind>.json (the e2e JSON
# without its per-prompt token lists), which `python scripts/make_docs.py` renders into docs/results.md.
# Nothing is tuned on these prompts. Takes minutes per kind on 2 CPU cores: run it on a quiet machine.
# Usage: bash scripts/bench_kinds.sh [KIND...]   (default: every kind)
#   env: SLIMSPEC (converted drafter folder, e.g. runs/quickstart/slimspec-r72-ft), DRAFTER, TARGET,
#        REPEATS (3), MAX_NEW_TOKENS (64), MAX_PROMPTS (10), OUT (results/smollm2/kinds), WORK (runs/kinds)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
KINDS=("$@")
[ ${#KINDS[@]} -gt 0 ] || KINDS=(writing qa math translation code summarisation)
DRAFTER=${DRAFTER:-drafters/smollm2-135m-eagle3}
REPEATS=${REPEATS:-3}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-64}
MAX_PROMPTS=${MAX_PROMPTS:-10}
OUT=${OUT:-results/smollm2/kinds}
WORK=${WORK:-runs/kinds}
TARGET=${TARGET:-$(slimspec fetch-smollm2)}
export SLIMSPEC_JOB="bash scripts/bench_kinds.sh${*:+ $*}"  # the results page cites it beside bench's command
mkdir -p "$OUT" "$WORK"
for kind in "${KINDS[@]}"; do
  prompts="data/eval/kinds/$kind.jsonl"
  [ -f "$prompts" ] || { echo "error: $prompts not found (python examples/make_kind_prompts.py)" >&2; exit 2; }
  echo "== $kind [${SECONDS} s]"
  drafters=(--drafter full="$DRAFTER" --drafter full-lookup3="$DRAFTER" --drafter-lookup full-lookup3=3)
  [ -z "${SLIMSPEC:-}" ] || drafters+=(--drafter slimspec="$SLIMSPEC")
  slimspec bench e2e --target "$TARGET" --prompts "$prompts" "${drafters[@]}" --reference full \
    --max-new-tokens "$MAX_NEW_TOKENS" --max-prompts "$MAX_PROMPTS" --repeats "$REPEATS" \
    --out "$WORK/$kind" --force
  python - "$WORK/$kind/e2e.json" "$OUT/$kind.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1], encoding="utf-8"))
d.pop("per_prompt", None)  # token lists: in the run folder, not in the committed results
with open(sys.argv[2], "w", encoding="utf-8") as f:
    json.dump(d, f, indent=1)
    f.write("\n")
PY
  echo "$OUT/$kind.json"
done
echo "done in ${SECONDS} s; python scripts/make_docs.py rebuilds docs/results.md"
