"""Copy-heavy prompts: training-side texts the target is asked to repeat, edit, quote or comment.

The target's greedy answers to them (``slimspec distill``) repeat long spans of their prompt, or
of themselves, which the target's own answers to ordinary prompts rarely do for long; a drafter
trained on them learns to copy from its context (the demo drafter's stage 11; the model card).
Texts: GPTeacher roleplay responses, OASST ``en_100_tree`` replies (prose, cut at a sentence end
near 600 characters) and GPTeacher codegen responses (code, near 700 characters); 7 prose and 3 code
templates. Twelve roleplay responses (``random.seed(123)``) are held out for
``data/heldout/copy12.jsonl``, each asked to be repeated word for word: how well a drafter copies
(``slimspec generate --prompts data/heldout/copy12.jsonl ...``).

Usage: python examples/make_copy_prompts.py   (writes data/train/copy_prompts/copy-prompts.jsonl,
1,200 prompts, and data/heldout/copy12.jsonl; deterministic)
"""

import json
import random
from pathlib import Path

ROLEPLAY = "data/train/gpteacher/roleplay-simple-deduped-roleplay-instruct.json"
CODEGEN = "data/train/gpteacher/codegen-instruct.json"
OASST = "data/train/oasst/en_100_tree.jsonl"
REPEAT = "Repeat the following text exactly, word for word:\n\n{t}"
PROSE = [
    REPEAT,
    "Here is a passage:\n\n{t}\n\nCopy the passage above, then add one sentence that summarizes it.",
    "Correct any spelling or grammar mistakes in this text and return the full corrected text:\n\n{t}",
    "Rewrite the following text, keeping every sentence but making it more formal:\n\n{t}",
    "Format the following text as a bulleted list, one bullet per sentence:\n\n{t}",
    "{t}\n\nQuote the first two sentences of the text above, then explain what they mean.",
    "Read this text and answer in full sentences that reuse its wording: what is it about?\n\n{t}",
]
CODE = [
    "Add helpful comments to this code and return the whole code:\n\n{t}",
    "Repeat this code exactly, then explain what it does:\n\n{t}",
    "Rename the variables in this code to clearer names and return the whole code:\n\n{t}",
]


def cut(text: str, n: int) -> str:
    """``text`` cut at the last sentence or line end within ``n`` characters (if past n/2)."""
    if len(text) <= n:
        return text.strip()
    s = text[:n]
    k = max(s.rfind(". "), s.rfind("\n"))
    return (s[: k + 1] if k > n // 2 else s).strip()


def write(path: str, records: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main() -> None:
    roleplay = json.load(open(ROLEPLAY))
    random.seed(123)
    held = random.sample(roleplay, 12)
    held_texts = {r["response"] for r in held}
    codes = [r["response"] for r in json.load(open(CODEGEN)) if len(r["response"]) > 120]
    oasst = [rep["text"] for line in open(OASST) for rep in json.loads(line)["prompt"].get("replies", [])]
    prose = [r["response"] for r in roleplay if r["response"] not in held_texts] + oasst
    random.seed(16)
    random.shuffle(prose)
    random.shuffle(codes)
    src = "examples/make_copy_prompts.py"
    out = [
        {"prompt": PROSE[i % len(PROSE)].format(t=cut(t, 600)), "source": src}
        for i, t in enumerate(prose[:800])
    ]
    out += [
        {"prompt": CODE[i % len(CODE)].format(t=cut(t, 700)), "source": src}
        for i, t in enumerate(codes[:400])
    ]
    random.shuffle(out)
    write("data/train/copy_prompts/copy-prompts.jsonl", out)
    write(
        "data/heldout/copy12.jsonl",
        [{"prompt": REPEAT.format(t=r["response"][:600]), "source": ROLEPLAY} for r in held],
    )
    print(len(out), "training prompts;", len(held), "held out")


if __name__ == "__main__":
    main()
