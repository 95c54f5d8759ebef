"""Training data for a Gemma 3 270M drafter: the target's own continuations of training-text prefixes.

Gemma 3 270M (``slimspec fetch gemma3-270m``) is a base model without a chat template, so its drafter
learns on completions: a prefix cut from a training-side text (``data/train/``: never ``data/eval/``)
after ``<bos>``, and the target's greedy continuation. Five kinds of text:

* ``prose``: OpenAssistant ``en_100_tree`` messages and GPTeacher roleplay responses;
* ``code``: GPTeacher codegen responses (several programming languages);
* ``math``: GSM8K train questions with the start of their worked answer;
* ``translate``: an English training-side sentence and "French:" (German, Spanish, ...), so the
  target writes other languages (the repository ships no training text in other languages);
* ``pyfunc``: a Python function's signature and docstring from the running interpreter's standard
  library (PSF-2.0; ``test``, ``idlelib``, ``lib2to3`` and installed packages left out), so the
  target writes the body: code in the form of a docstring-first prompt, which the GPTeacher
  responses rarely take (``--kinds pyfunc``; the default plans the first four).

Every source item is assigned to ``train`` or ``heldout`` by a hash of its source and index (5% held
out); ``--heldout N`` writes N held-out prompts per kind as ``{"prompt", "kind", ...}`` lines (the
drafter's selection metric and ``--draft auto``'s planning prompts), ``--out DIR`` writes the
continuations of the train split (``--split heldout``: of the held-out split, kinds interleaved, so
``--num 48`` answers the 12 held-out prompts of each kind: the rank sweep's data). A plan of
prefixes is drawn once from ``--seed`` (kinds interleaved), and the run appends records to
``DIR/completions-NNN.jsonl``; a piece of ``--piece-records`` records is gzipped to
``completions-NNN.jsonl.gz`` when full (``--seal`` gzips the open piece too, to commit it). A rerun
skips every planned item already written (plain or gzipped), so it resumes after a kill. A record:

    {"prefix": "...", "completion": "...", "kind": "code",
     "provenance": {"source": "data/train/gpteacher/codegen-instruct.json", "index": 12, "cut": 180,
                    "decoding": {...}, "new_tokens": 128, "prefix_tokens": 57, "target": "<sha>"}}

Usage (background; about 250 new tokens/s on 2 cores with batches of 32):

    T=$(slimspec fetch gemma3-270m)
    OMP_NUM_THREADS=2 python examples/gemma_completions.py --target "$T" --out data/train/gemma3 \
        --batch-size 32
    python examples/gemma_completions.py --heldout 12   # data/heldout/gemma3-completions.jsonl
    python examples/gemma_completions.py --target "$T" --split heldout --num 48 --out data/heldout/gemma3
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "data" / "train"
LANGUAGES = (
    "French",
    "German",
    "Spanish",
    "Italian",
    "Portuguese",
    "Dutch",
    "Chinese",
    "Japanese",
    "Russian",
)
KINDS = ("prose", "code", "math", "translate")
ALL_KINDS = (*KINDS, "pyfunc")  # pyfunc came later: the first four keep their plan and held-out file
HELDOUT_PERCENT = 5


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _split(source: str, index: int) -> str:
    h = int(hashlib.sha256(f"{source}:{index}".encode()).hexdigest()[:8], 16)
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def _oasst_texts(path: Path) -> list[str]:
    out = []

    def walk(m):
        out.append(m["text"])
        for r in m.get("replies", []):
            walk(r)

    for line in path.read_text().splitlines():
        if line.strip():
            walk(json.loads(line)["prompt"])
    return out


def _stdlib_functions() -> list[tuple[str, list[str]]]:
    """(``pythonX.Y-stdlib/<file>``, its functions' signature-and-docstring prefixes), files sorted.

    A prefix is a function's ``def`` line(s) and docstring, dedented to column 0, ending in a newline
    (the form of a docstring-first prompt); a function qualifies with a docstring of 40-600
    characters and at least 3 body lines after it.
    """
    import ast
    import sysconfig
    import textwrap

    root = Path(sysconfig.get_paths()["stdlib"])
    tag = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("test", "idlelib", "site-packages", "lib2to3") or "tests" in rel.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        texts = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node, clean=False)
            first = node.body[0]
            if doc is None or not 40 <= len(doc) <= 600 or node.end_lineno - first.end_lineno < 3:
                continue
            head = "\n".join(lines[node.lineno - 1 : first.end_lineno])
            text = textwrap.dedent(head)
            if text[:1].isspace():  # a docstring line left of the def: strip the def's indent alone
                text = "\n".join(re.sub(rf"^\s{{0,{node.col_offset}}}", "", x) for x in head.split("\n"))
            texts.append(text + "\n")
        if texts:
            out.append((f"{tag}/{rel.as_posix()}", texts))
    return out


def sources(kinds: tuple[str, ...] = ALL_KINDS) -> dict[str, list[tuple[str, list[str]]]]:
    """Per kind of ``kinds``, (source file, its texts in file order); the stdlib is read only for pyfunc."""
    gpt = TRAIN / "gpteacher"
    roleplay = gpt / "roleplay-simple-deduped-roleplay-instruct.json"
    codegen = gpt / "codegen-instruct.json"
    oasst = TRAIN / "oasst" / "en_100_tree.jsonl"
    gsm = TRAIN / "gsm8k" / "train.jsonl"
    role_texts = [r["response"] for r in json.loads(roleplay.read_text())]
    code_texts = [r["response"] for r in json.loads(codegen.read_text())]
    gsm_recs = [json.loads(x) for x in gsm.read_text().splitlines() if x.strip()]
    out = {
        "prose": [(_rel(oasst), _oasst_texts(oasst)), (_rel(roleplay), role_texts)],
        "code": [(_rel(codegen), code_texts)],
        "math": [(_rel(gsm), [json.dumps([r["question"], r["answer"]]) for r in gsm_recs])],
        "translate": [(_rel(oasst), _oasst_texts(oasst)), (_rel(roleplay), role_texts)],
    }
    if "pyfunc" in kinds:
        out["pyfunc"] = _stdlib_functions()
    return {k: v for k, v in out.items() if k in kinds}


def _cut_at_space(text: str, at: int) -> int:
    """The end of the word at or after character ``at`` (so a prefix never ends inside a word)."""
    m = re.compile(r"\s").search(text, at)
    return m.start() if m else len(text)


def make_prefix(kind: str, text: str, rng: random.Random) -> tuple[str, int] | None:
    """(prefix, cut) for one source text, None when the text does not suit the kind."""
    if kind == "pyfunc":
        return text, len(text)
    if kind == "math":
        question, answer = json.loads(text)
        cut = _cut_at_space(answer, rng.randint(0, len(answer) // 2)) if rng.random() < 0.6 else 0
        return f"Question: {question}\nAnswer: {answer[:cut]}".rstrip(" "), cut
    if kind == "translate":
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if 40 <= len(s) <= 240 and "\n" not in s]
        if not sentences:
            return None
        i = rng.randrange(len(sentences))
        lang = rng.choice(LANGUAGES)
        return f"English: {sentences[i]}\n{lang}:", i
    if len(text) < 200:
        return None
    cut = _cut_at_space(text, rng.randint(60, min(600, len(text) // 2)))
    return text[:cut].rstrip(), cut  # never end on whitespace (a split token)


def plan(split: str, seed: int, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """Every (kind, source, index) of ``split`` with its prefix, ``kinds`` interleaved in a seeded order."""
    per_kind = {}
    for kind, files in sources(kinds).items():
        items = []
        for source, texts in files:
            for index, text in enumerate(texts):
                if _split(source, index) != split:
                    continue
                rng = random.Random(f"{seed}:{kind}:{source}:{index}")
                got = make_prefix(kind, text, rng)
                if got is not None:
                    items.append(
                        {"kind": kind, "source": source, "index": index, "prefix": got[0], "cut": got[1]}
                    )
        random.Random(f"{seed}:{kind}").shuffle(items)
        per_kind[kind] = items
    out = []
    for i in range(max(len(v) for v in per_kind.values())):
        out.extend(v[i] for k, v in per_kind.items() if i < len(v))
    return out


def _key(rec: dict) -> str:
    p = rec["provenance"] if "provenance" in rec else rec
    return f"{p['kind'] if 'kind' in p else rec['kind']}:{p['source']}:{p['index']}"


def _pieces(out: Path) -> list[Path]:
    return sorted(out.glob("completions-*.jsonl")) + sorted(out.glob("completions-*.jsonl.gz"))


def _read_lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # a killed write: drop the unfinished line
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    return data.decode("utf-8").splitlines()


def done_keys(out: Path) -> set[str]:
    keys = set()
    for p in _pieces(out):
        for line in _read_lines(p):
            if line.strip():
                rec = json.loads(line)
                keys.add(f"{rec['kind']}:{rec['provenance']['source']}:{rec['provenance']['index']}")
    return keys


def seal(piece: Path) -> None:
    """Gzip a plain piece (deterministic bytes: no name, mtime 0) and remove the plain file."""
    gz = piece.with_suffix(".jsonl.gz")
    tmp = gz.with_suffix(".gz.tmp")
    with (
        open(tmp, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f,
    ):
        f.write(piece.read_bytes())
    tmp.replace(gz)
    piece.unlink()


def open_piece(out: Path, piece_records: int) -> tuple[Path, int]:
    """The plain piece to append to (a new number when none is open), and its record count."""
    plain = sorted(out.glob("completions-*.jsonl"))
    if plain:
        return plain[-1], len([x for x in _read_lines(plain[-1]) if x.strip()])
    numbers = [int(p.name.split("-")[1].split(".")[0]) for p in _pieces(out)]
    return out / f"completions-{max(numbers, default=-1) + 1:03d}.jsonl", 0


def write_heldout(path: Path, per_kind: int, seed: int, kinds: tuple[str, ...] = KINDS) -> None:
    items = plan("heldout", seed, kinds)
    chosen = {k: [x for x in items if x["kind"] == k][:per_kind] for k in kinds}
    with open(path, "w", encoding="utf-8") as f:  # kinds interleaved: the first N prompts cover all
        for i in range(per_kind):
            for k in kinds:
                x = chosen[k][i]
                rec = {"prompt": x["prefix"], "kind": k, "source": x["source"], "index": x["index"]}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"wrote {sum(len(v) for v in chosen.values())} held-out prompts to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="the Gemma 3 folder (slimspec fetch gemma3-270m)")
    ap.add_argument("--out", type=Path, help="output folder of the pieces")
    ap.add_argument("--num", type=int, default=20000, help="planned prefixes to answer (in plan order)")
    ap.add_argument(
        "--split",
        choices=("train", "heldout"),
        default="train",
        help="whose prefixes to answer: train, or heldout (held-out continuations, e.g. for rank-sweep)",
    )
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prefix-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--piece-records", type=int, default=1024)
    ap.add_argument("--seal", action="store_true", help="gzip the open piece and stop")
    ap.add_argument("--heldout", type=int, default=0, help="write N held-out prompts per kind and stop")
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated kinds to plan, of {', '.join(ALL_KINDS)} (default: the first four)",
    )
    ap.add_argument(
        "--heldout-out", type=Path, default=REPO / "data" / "heldout" / "gemma3-completions.jsonl"
    )
    args = ap.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown or not kinds:
        ap.error(f"--kinds: unknown kind(s) {unknown or args.kinds!r}; choose from {', '.join(ALL_KINDS)}")
    if args.heldout:
        write_heldout(args.heldout_out, args.heldout, args.seed, kinds)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.seal:
        for p in sorted(args.out.glob("completions-*.jsonl")):
            seal(p)
        return

    import torch

    from slimspec_convert.data.distill import DistillConfig, generate_answers, target_fingerprint
    from slimspec_convert.targets.load import load_target

    model, tok = load_target(args.target, args.dtype)
    target_sha, _ = target_fingerprint(model, tok)
    cfg = DistillConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    decoding = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "dtype": args.dtype}
    done = done_keys(args.out)
    todo = []
    for x in plan(args.split, args.seed, kinds)[: args.num]:
        if f"{x['kind']}:{x['source']}:{x['index']}" in done:
            continue
        n = len(tok(x["prefix"])["input_ids"])
        if n <= args.max_prefix_tokens:
            todo.append((x, n))
    print(f"{len(done)} done, {len(todo)} to answer", file=sys.stderr, flush=True)
    piece, count = open_piece(args.out, args.piece_records)
    t0, new_tokens = time.perf_counter(), 0
    for b in range(0, len(todo), args.batch_size):
        chunk = todo[b : b + args.batch_size]
        with torch.inference_mode():
            answers = generate_answers(model, tok, [tok.bos_token + x["prefix"] for x, _ in chunk], cfg)
        with open(piece, "a", encoding="utf-8") as f:
            for (x, n), ids in zip(chunk, answers, strict=True):
                new_tokens += len(ids)
                prov = {
                    "source": x["source"],
                    "index": x["index"],
                    "cut": x["cut"],
                    "decoding": decoding,
                    "new_tokens": len(ids),
                    "prefix_tokens": n,
                    "target": target_sha,
                }
                completion = tok.decode(ids, skip_special_tokens=True)
                rec = {"prefix": x["prefix"], "completion": completion, "kind": x["kind"], "provenance": prov}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        count += len(chunk)
        rate = new_tokens / (time.perf_counter() - t0)
        print(
            f"{b + len(chunk)}/{len(todo)} answered, {new_tokens} tokens, {rate:.1f} tokens/s",
            file=sys.stderr,
            flush=True,
        )
        if count >= args.piece_records:
            seal(piece)
            piece, count = open_piece(args.out, args.piece_records)


if __name__ == "__main__":
    main()
