"""Self-distilled training data: the target's own answers to the user turns of training files.

Speculation runs on the target's own text, so a drafter should learn (and be selected) on that text,
not on human-written answers. :func:`distill` takes the first user turn of every conversation or
prompt record (with its system message, if any), renders it with the target's chat template,
decodes the answer with Hugging Face ``model.generate`` (left-padded batches; greedy by default,
``temperature``/``top_p`` for sampled data) and appends one conversation per line to a JSONL file:

    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}],
     "provenance": {"source": "data/train/gsm8k/train.jsonl", "line": 12, "target": "<config sha>",
                    "chat_template": "<sha>", "decoding": {...}, "new_tokens": 87, "version": "0.1.0"}}

``shuffle`` answers the prompts in a seeded order so that a partial run covers every source;
``exclude`` leaves out the prompts of given files (one's held-out measurement prompts).
Re-running appends only what is missing (a record is identified by source, line and decoding
settings), and every batch is flushed, so a killed run loses at most the batch in flight. Benchmark
prompts (MT-Bench, HumanEval, GSM8K test, the EAGLE evaluation sets) are refused as sources unless
``allow_eval_data``: a source is refused when one of its prompts equals a prompt of the committed
evaluation sets, or when it lies under the repository's ``data/eval/``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from slimspec_convert.data.records import (
    PREFIX_ROLE,
    DataError,
    Message,
    _read_records,
    jsonl_lines,
    read_text,
    record_to_conversations,
)
from slimspec_convert.targets.load import bos_text, resolve_chat
from slimspec_convert.version import __version__

logger = logging.getLogger(__name__)

PROMPT_ROLES = ("user", PREFIX_ROLE)  # a chat prompt, or the raw text of a completion record


EVAL_DIR = Path(__file__).resolve().parents[2] / "data" / "eval"  # present in a source checkout


@dataclass(frozen=True)
class DistillConfig:
    """Options of ``slimspec distill``.

    Attributes:
        batch_size: prompts per ``model.generate`` call (left padding).
        max_new_tokens: answer length cap.
        temperature: 0 = greedy (deterministic); > 0 samples with ``top_p``.
        top_p: nucleus mass for sampled data.
        seed: sampling seed (per batch: seed + batch index).
        limit: use at most this many prompts (in file order), None = all.
        system_prompt: a system message for every prompt (None keeps the source's, else the template's).
        allow_eval_data: accept benchmark prompts as a source (off: refused by name).
        max_prompt_tokens: longer rendered prompts are skipped (counted).
        shuffle: answer the prompts in an order drawn from ``seed`` (before ``limit``), so that a
            partial run covers every source file, each window of 8 batches sorted by prompt length
            (less padding); False keeps file order.
        exclude: files whose prompts are left out (matched by their whitespace-normalised first user
            turn): the held-out prompts of one's own measurements.
        chat: render prompts with the chat template (True) or as raw completion text after ``<bos>``
            (False); None follows the tokenizer (:func:`~slimspec_convert.targets.load.resolve_chat`).
    """

    batch_size: int = 64  # CPU: 143 tokens/s at 64 vs 55 at 16 (SmolLM2-135M, 2 cores)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    limit: int | None = None
    system_prompt: str | None = None
    allow_eval_data: bool = False
    max_prompt_tokens: int = 1024
    shuffle: bool = False
    exclude: tuple[str, ...] = ()
    chat: bool | None = None  # chat template / completion prompts; None: the tokenizer decides

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"DistillConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.temperature < 0:
            raise ValueError(f"DistillConfig.temperature={self.temperature}: expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"DistillConfig.top_p={self.top_p}: expected 0 < P <= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"DistillConfig.limit={self.limit}: expected >= 1")

    def decoding(self) -> dict:
        """The settings that change the answers (part of each record's identity)."""
        d = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "system_prompt": self.system_prompt,
        }
        if self.temperature > 0:
            d.update(top_p=self.top_p, seed=self.seed)
        return d


@dataclass(frozen=True)
class PromptRecord:
    """One prompt to answer: where it came from and the messages up to the first user turn."""

    source: str
    line: int
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs

    def as_messages(self) -> list[Message]:
        return [{"role": r, "content": c} for r, c in self.messages]


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _eval_prompt_index(eval_dir: Path = EVAL_DIR) -> dict[str, str]:
    """Normalised text of every committed evaluation prompt -> the benchmark file it belongs to (a
    record's own ``source`` when it names one: the per-kind prompts of data/eval/kinds cite their
    upstream benchmark)."""
    index: dict[str, str] = {}
    if not eval_dir.is_dir():
        return index
    for path in sorted(eval_dir.rglob("*.jsonl*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                texts = rec.get("turns") or [rec.get("prompt") or rec.get("question") or ""]
                where = rec.get("source") or str(path.relative_to(eval_dir.parent.parent))
                for t in texts:
                    if isinstance(t, str) and t.strip():
                        index.setdefault(_normalise(t), where)
    return index


def read_prompts(paths: list[str | Path], allow_eval_data: bool = False) -> list[PromptRecord]:
    """The first user turn (with a leading system message) of every record of ``paths``.

    Raises:
        FileNotFoundError: a missing file.
        DataError: malformed data, or a benchmark prompt in a source while ``allow_eval_data`` is off
            (naming the file, the line and the benchmark).
    """
    index = {} if allow_eval_data else _eval_prompt_index()
    out = []
    for p in paths:
        path = Path(p)
        if not allow_eval_data and EVAL_DIR.is_dir() and path.resolve().is_relative_to(EVAL_DIR):
            raise DataError(
                f"{path}: an evaluation set, refused as training data (--allow-eval-data overrides)"
            )
        for lineno, rec in _read_records(path):
            for conv in record_to_conversations(rec, f"{path}:{lineno}"):
                first_user = next((i for i, m in enumerate(conv) if m["role"] in PROMPT_ROLES), None)
                if first_user is None:
                    continue
                msgs = [m for m in conv[:first_user] if m["role"] == "system"] + [conv[first_user]]
                bench = index.get(_normalise(conv[first_user]["content"]))
                if bench is not None:
                    raise DataError(
                        f"{path}:{lineno}: this prompt is in the benchmark {bench}; refused as training data "
                        "(--allow-eval-data overrides)"
                    )
                out.append(PromptRecord(str(path), lineno, tuple((m["role"], m["content"]) for m in msgs)))
    return out


def is_distilled(paths: list[str | Path]) -> bool:
    """True when every file's first record carries distillation provenance (a file :func:`distill` wrote)."""
    for p in paths:
        try:
            first = next(_read_records(Path(p)), (0, None))[1]
        except DataError:
            return False
        if not isinstance(first, dict) or "provenance" not in first:
            return False
    return bool(paths)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def target_fingerprint(model, tokenizer) -> tuple[str, str]:
    """(hash of the target's config.json content, hash of its chat template)."""
    cfg = (
        model.config.to_json_string(use_diff=False)
        if hasattr(model.config, "to_json_string")
        else str(model.config)
    )
    return _sha(cfg), _sha(str(getattr(tokenizer, "chat_template", None)))


def _record_key(source: str, line: int, decoding: dict) -> str:
    return f"{source}:{line}:{json.dumps(decoding, sort_keys=True)}"


def _drop_partial_tail(out: Path) -> None:
    """Cut a last line without its newline (a write killed mid-record), so appends start on a fresh line."""
    if not out.is_file() or out.stat().st_size == 0:
        return
    data = out.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    logger.warning("%s: dropping an unfinished last record (%d bytes, a killed write)", out, len(data) - keep)
    with open(out, "r+b") as f:
        f.truncate(keep)


def _done_keys(out: Path) -> set[str]:
    done = set()
    _drop_partial_tail(out)
    if not out.is_file():
        return done
    for lineno, raw in jsonl_lines(read_text(out)):
        try:
            prov = json.loads(raw)["provenance"]
        except (json.JSONDecodeError, KeyError, TypeError):
            logger.warning(
                "%s:%d: unreadable distilled record (a killed write?); it will be redone", out, lineno
            )
            continue
        done.add(_record_key(prov["source"], prov["line"], prov["decoding"]))
    return done


def _render(tokenizer, rec: PromptRecord, system_prompt: str | None, chat: bool = True) -> str:
    if not chat:  # a completion prompt: the user turn's text after <bos>
        return bos_text(tokenizer) + rec.messages[-1][1]
    msgs = rec.as_messages()
    if system_prompt is not None:
        msgs = [{"role": "system", "content": system_prompt}] + [m for m in msgs if m["role"] != "system"]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def _batches(items: list, size: int) -> Iterator[tuple[int, list]]:
    for i in range(0, len(items), size):
        yield i // size, items[i : i + size]


class _EveryStep(StoppingCriteria):
    """Calls ``on_step()`` once per token step of ``model.generate``; stops nothing (a progress hook)."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self.on_step = on_step

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.on_step()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate_answers(
    model,
    tokenizer,
    texts: list[str],
    cfg: DistillConfig,
    batch_index: int = 0,
    on_step: Callable[[], None] | None = None,
) -> list[list[int]]:
    """The target's answer ids to rendered prompts (one left-padded ``model.generate`` call).

    Args:
        model: HF causal LM.
        tokenizer: its tokenizer.
        texts: rendered prompts.
        cfg: decoding settings (``max_new_tokens``, temperature, top_p, seed).
        batch_index: added to the seed of a sampled batch.
        on_step: called after every generated token step of the batch (a progress bar's tick), so
            a batch of 64 prompts x 192 tokens shows 192 steps, not one jump at the end.

    Returns:
        One list of new token ids per prompt, without padding, cut after the first stop token.
    """
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    finally:
        tokenizer.padding_side = side
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    if cfg.temperature > 0:
        torch.manual_seed(cfg.seed + batch_index)
        kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if on_step is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([_EveryStep(on_step)])
    out = model.generate(**enc, **kwargs)[:, enc["input_ids"].shape[1] :]
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    answers = []
    for row in out.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        answers.append(row[:cut])
    return answers


@dataclass
class DistillReport:
    """What :func:`distill` did: prompts seen, answered now, already present, skipped; tokens and speed."""

    out: str
    num_prompts: int
    num_written: int
    num_present: int
    num_skipped_long: int
    new_tokens: int
    seconds: float
    num_excluded: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}

    def summary(self) -> str:
        return (
            f"distilled {self.num_written} answers ({self.new_tokens} tokens, "
            f"{self.tokens_per_s:.1f} tokens/s) "
            f"into {self.out}; {self.num_present} already there, {self.num_skipped_long} prompts too long, "
            f"{self.num_excluded} excluded"
        )


def distill(
    model,
    tokenizer,
    data: list[str | Path],
    out: str | Path,
    cfg: DistillConfig,
    only: set[tuple[str, int]] | None = None,
) -> DistillReport:
    """Write the target's answers to the prompts of ``data`` into the JSONL file ``out`` (appending).

    Args:
        model: the target HF causal LM (eval mode; its device is used).
        tokenizer: its tokenizer, with a chat template.
        data: training files in any format :func:`read_conversations` reads.
        out: the JSONL file (created, or extended with what is missing).
        cfg: :class:`DistillConfig`.
        only: answer only the records with these (source, line) keys (None = all, then ``cfg.limit``).

    The model's dtype is part of each record's decoding settings when it is not float32 (a bfloat16
    target answers a little differently).

    Returns:
        :class:`DistillReport`.

    Raises:
        DataError: bad data, a benchmark source (see :func:`read_prompts`), no prompt at all, or a
            gzip ``out`` (answers are appended as plain JSONL).
    """
    from tqdm.auto import tqdm

    out = Path(out)
    if out.suffix == ".gz":
        raise DataError(f"{out}: distill appends plain JSONL; write FILE.jsonl (gzip it afterwards)")
    prompts = read_prompts(list(data), cfg.allow_eval_data)
    if only is not None:
        prompts = [p for p in prompts if (p.source, p.line) in only]
    excluded = 0
    if cfg.exclude:
        held = {_normalise(r.messages[-1][1]) for r in read_prompts(list(cfg.exclude), allow_eval_data=True)}
        kept = [p for p in prompts if _normalise(p.messages[-1][1]) not in held]
        excluded, prompts = len(prompts) - len(kept), kept
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(prompts)
    prompts = prompts[: cfg.limit]
    if not prompts:
        raise DataError(f"{', '.join(map(str, data))}: no user turn to answer")
    decoding = cfg.decoding()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dtype != "float32":  # float32 records keep the identity they always had
        decoding["dtype"] = dtype
    mode = resolve_chat(tokenizer, cfg.chat)
    logger.info("%s", mode.summary())
    chat = mode.chat
    if not chat:
        decoding["prompt"] = "completion"
    done = _done_keys(out)
    todo, skipped = [], 0
    for rec in prompts:
        if _record_key(rec.source, rec.line, decoding) in done:
            continue
        text = _render(tokenizer, rec, cfg.system_prompt, chat)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        todo.append((rec, text, len(ids)))
    if cfg.shuffle:  # sort each window of 8 batches by prompt length: less left padding, same coverage
        w = 8 * cfg.batch_size
        todo = [x for i in range(0, len(todo), w) for x in sorted(todo[i : i + w], key=lambda x: x[2])]
    target_sha, template_sha = target_fingerprint(model, tokenizer)
    t0, new_tokens = time.perf_counter(), 0
    out.parent.mkdir(parents=True, exist_ok=True)
    # the bar moves per token step of each batch (a batch of 64 prompts is one generate call; a bar
    # per prompt would sit at 0/64 until it ends): total = batches x max_new_tokens steps
    num_batches = -(-len(todo) // cfg.batch_size)
    bar = tqdm(total=num_batches * cfg.max_new_tokens, desc="distill", unit="step")
    answered = 0
    with open(out, "a", encoding="utf-8") as f:
        for b, chunk in _batches(todo, cfg.batch_size):
            end = (b + 1) * cfg.max_new_tokens
            answers = generate_answers(
                model,
                tokenizer,
                [t for _, t, _ in chunk],
                cfg,
                batch_index=b,
                on_step=lambda end=end: bar.update(1) if bar.n < end else None,
            )
            for (rec, _, _), ids in zip(chunk, answers, strict=True):
                new_tokens += len(ids)
                answer = tokenizer.decode(ids, skip_special_tokens=True)
                prov = {
                    "source": rec.source,
                    "line": rec.line,
                    "target": target_sha,
                    "chat_template": template_sha,
                    "decoding": decoding,
                    "new_tokens": len(ids),
                    "version": __version__,
                }
                msgs = rec.as_messages() + [{"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": msgs, "provenance": prov}) + "\n")
            f.flush()
            answered += len(chunk)
            bar.update(end - bar.n)  # the batch stopped early (every answer ended)
            bar.set_postfix(
                prompts=f"{answered}/{len(todo)}",
                tokens_per_s=f"{new_tokens / (time.perf_counter() - t0):.1f}",
            )
    bar.close()
    return DistillReport(
        str(out),
        len(prompts),
        len(todo),
        len(prompts) - len(todo) - skipped,
        skipped,
        new_tokens,
        time.perf_counter() - t0,
        excluded,
    )
