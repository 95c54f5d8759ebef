"""Held-out evaluation prompts per kind of request: writing, question answering, math, code,
translation and summarisation, 10 each, for ``scripts/bench_kinds.sh`` (docs/results.md reports where
speculation pays and where it does not).

Every prompt comes from an evaluation file under ``data/eval/`` (never trained or tuned on: data/README.md),
picked by a fixed rule, so the files are rebuilt byte for byte:

* writing: the first turns of MT-Bench's 10 ``writing`` questions (Apache-2.0);
* qa: the first turns of MT-Bench's 10 ``stem`` questions (science and engineering questions);
* math: the first 10 GSM8K test questions (MIT);
* code: the first 10 HumanEval prompts, asked as EAGLE's HumanEval set asks them, "Complete the code I
  provided." (MIT);
* translation: the first sentence of GSM8K test questions 11-20, to be translated into French, German,
  Spanish, Italian and Portuguese in turn;
* summarisation: GSM8K test questions 21-30 (short narratives), to be summarised in one sentence.

Each line: ``{"prompt", "kind", "source", "line"}`` (the source file and its 1-based line).

``--completion`` writes the *completion* prompts of a base-model target (Gemma 3 270M has no chat
template: it continues raw text) to ``data/eval/kinds-completion/``, one file per kind the Gemma 3
drafter's training data has (prose, code, math, translation), in the same text forms as that data
(``examples/gemma_completions.py``), drawn from evaluation files only:

* prose: the first third (cut at a word end) of the reference answers of EAGLE's Alpaca set, 1-10;
* code: HumanEval prompts 1-10 as they are (a signature and docstring to continue);
* math: ``"Question: {q}\nAnswer:"`` for GSM8K test questions 1-10;
* translation: ``"English: {first sentence}\n{language}:"`` for GSM8K test questions 11-20, the
  language cycling through French, German, Spanish, Italian and Portuguese.

Usage: python examples/make_kind_prompts.py [--completion]
  (writes data/eval/kinds[-completion]/<kind>.jsonl;
deterministic)
"""

import gzip
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EVAL = ROOT / "data" / "eval"
OUT = EVAL / "kinds"
OUT_COMPLETION = EVAL / "kinds-completion"
PER_KIND = 10
MT_BENCH = "data/eval/mt_bench/question.jsonl"
GSM8K = "data/eval/gsm8k/test.jsonl"
HUMANEVAL = "data/eval/humaneval/HumanEval.jsonl.gz"
ALPACA = "data/eval/eagle/alpaca/question.jsonl"
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese")


def read_jsonl(rel: str) -> list[dict]:
    """Records of a JSONL file (gzip when it ends in .gz), in file order."""
    path = ROOT / rel
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def record(prompt: str, kind: str, source: str, line: int) -> dict:
    return {"prompt": prompt, "kind": kind, "source": source, "line": line}


def first_sentence(text: str) -> str:
    """The text up to its first sentence end (``.``, ``?`` or ``!`` followed by a space), or all of it."""
    m = re.search(r"[.?!](\s|$)", text)
    return text[: m.end()].strip() if m else text.strip()


def kinds() -> dict[str, list[dict]]:
    """kind -> its prompt records (the module docstring's rules)."""
    mt = list(enumerate(read_jsonl(MT_BENCH), 1))
    gsm = list(enumerate(read_jsonl(GSM8K), 1))
    code = list(enumerate(read_jsonl(HUMANEVAL), 1))

    def mt_category(category: str, kind: str) -> list[dict]:
        rows = [(n, q) for n, q in mt if q["category"] == category][:PER_KIND]
        return [record(q["turns"][0], kind, MT_BENCH, n) for n, q in rows]

    out = {
        "writing": mt_category("writing", "writing"),
        "qa": mt_category("stem", "qa"),
        "math": [record(q["question"], "math", GSM8K, n) for n, q in gsm[:PER_KIND]],
        "code": [
            record("Complete the code I provided.\n\n" + t["prompt"], "code", HUMANEVAL, n)
            for n, t in code[:PER_KIND]
        ],
        "translation": [
            record(
                f"Translate into {LANGUAGES[i % len(LANGUAGES)]}: {first_sentence(q['question'])}",
                "translation",
                GSM8K,
                n,
            )
            for i, (n, q) in enumerate(gsm[PER_KIND : 2 * PER_KIND])
        ],
        "summarisation": [
            record(
                f"Summarise the following text in one sentence.\n\n{q['question']}", "summarisation", GSM8K, n
            )
            for n, q in gsm[2 * PER_KIND : 3 * PER_KIND]
        ],
    }
    for kind, rows in out.items():
        assert len(rows) == PER_KIND, (kind, len(rows))
    return out


def first_third(text: str) -> str:
    """The first third of ``text``, extended to the end of the word it cuts (never ending on a space)."""
    m = re.compile(r"\s").search(text, len(text) // 3)
    return text[: m.start() if m else len(text)].rstrip()


def completion_kinds() -> dict[str, list[dict]]:
    """kind -> completion prompt records for a base-model target (the module docstring's rules)."""
    alpaca = [(n, q) for n, q in enumerate(read_jsonl(ALPACA), 1) if len(q["reference"][0]) >= 300]
    gsm = list(enumerate(read_jsonl(GSM8K), 1))
    code = list(enumerate(read_jsonl(HUMANEVAL), 1))
    out = {
        "prose": [record(first_third(q["reference"][0]), "prose", ALPACA, n) for n, q in alpaca[:PER_KIND]],
        "code": [record(t["prompt"], "code", HUMANEVAL, n) for n, t in code[:PER_KIND]],
        "math": [record(f"Question: {q['question']}\nAnswer:", "math", GSM8K, n) for n, q in gsm[:PER_KIND]],
        "translation": [
            record(
                f"English: {first_sentence(q['question'])}\n{LANGUAGES[i % len(LANGUAGES)]}:",
                "translation",
                GSM8K,
                n,
            )
            for i, (n, q) in enumerate(gsm[PER_KIND : 2 * PER_KIND])
        ],
    }
    for kind, rows in out.items():
        assert len(rows) == PER_KIND, (kind, len(rows))
    return out


def main() -> None:
    completion = "--completion" in sys.argv[1:]
    out_dir, table = (OUT_COMPLETION, completion_kinds()) if completion else (OUT, kinds())
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind, rows in table.items():
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (out_dir / f"{kind}.jsonl").write_text(text, encoding="utf-8")
        print(f"{out_dir.relative_to(ROOT) / kind}.jsonl: {len(rows)} prompts")


if __name__ == "__main__":
    main()
