"""Self-written prompts: the target writes the user turns it will then answer (Magpie).

An instruction-tuned target, given its chat template's text up to the start of a user turn and
nothing else, writes a plausible user request (Xu et al., "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing", arXiv 2406.08464, section 2). Sampled this way,
SmolLM2-135M-Instruct writes general chat requests ("Can you recommend a healthy meal plan for a
toddler with allergies?"), a source of prompts without limit and under the target's own licence,
for the on-policy recipe once the training prompts are used up: answer them with
``slimspec distill --data PROMPTS.jsonl``.

Each line of the output is ``{"prompt": str, "self_prompt": {...}}`` (``records.py`` reads a
``{"prompt": str}`` record as one user turn); ``self_prompt`` holds the target and chat-template
hashes, the sampling settings and the batch it came from. Kept are finished turns (the target
closed the turn before ``max_new_tokens``) of at least ``min_words`` words that are new
(whitespace-normalised, case-folded, in this file) and are no evaluation prompt and share no
``overlap_words``-word run with one (``data/eval``: MT-Bench, HumanEval, GSM8K test, the EAGLE
sets).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from slimspec_convert.data.distill import (
    DistillConfig,
    drop_partial_tail,
    eval_prompt_index,
    generate_answers,
    normalise,
    target_fingerprint,
)
from slimspec_convert.data.records import DataError, jsonl_lines, read_text

_SENTINEL = "\u2063SLIMSPEC-USER-TURN\u2063"


@dataclass(frozen=True)
class SelfPromptConfig:
    """Settings of :func:`self_prompts`.

    Attributes:
        num: prompts the output file should hold (a rerun appends until it does).
        seed: sampling seed; batch ``b`` samples with ``seed + b`` (reproducible, resumable).
        temperature: sampling temperature (Magpie: 1.0).
        top_p: nucleus mass.
        max_new_tokens: cap on a user turn's length; unfinished turns are dropped.
        batch_size: user turns sampled per ``model.generate`` call.
        min_words: shorter turns are dropped.
        overlap_words: a turn sharing a run of this many words with an evaluation prompt is dropped.
        system_prompt: the system message rendered before the user turn (None: the template's own).
        max_batches: give up after this many batches (a target that rarely closes its turn).
    """

    num: int
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 128
    batch_size: int = 64
    min_words: int = 4
    overlap_words: int = 8
    system_prompt: str | None = None
    max_batches: int = 10_000

    def __post_init__(self) -> None:
        for name in ("num", "max_new_tokens", "batch_size", "min_words", "overlap_words", "max_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"SelfPromptConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.temperature <= 0:
            raise ValueError(f"SelfPromptConfig.temperature={self.temperature}: expected > 0 (sampling)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SelfPromptConfig.top_p={self.top_p}: expected 0 < P <= 1")


def user_turn_prefix(tokenizer, system_prompt: str | None = None) -> str:
    """The chat template's text up to where a first user turn's content starts.

    Rendering ``prefix + text + rest`` reproduces the template's rendering of a conversation whose
    first user turn is ``text`` (the Magpie premise; tested).

    Raises:
        DataError: the tokenizer has no chat template, or its template does not copy the user
            content verbatim.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template: no user turn to write")
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    text = tokenizer.apply_chat_template(msgs + [{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise DataError("the target's chat template does not copy the user content verbatim")
    return text[: text.index(_SENTINEL)]


def _dedup_key(text: str) -> str:
    return normalise(text).lower()


def _words(text: str) -> list[str]:
    return text.lower().split()


def eval_word_runs(n: int, index: dict[str, str] | None = None) -> set[str]:
    """Every run of ``n`` words (lower-cased) of every committed evaluation prompt."""
    index = eval_prompt_index() if index is None else index
    runs = set()
    for text in index:
        w = _words(text)
        runs.update(" ".join(w[i : i + n]) for i in range(len(w) - n + 1))
    return runs


def drop_reason(
    text: str, seen: set[str], eval_index: dict[str, str], eval_runs: set[str], cfg: SelfPromptConfig
) -> str | None:
    """Why a sampled user turn is dropped (``"short"``, ``"duplicate"``, ``"eval"``, ``"overlap"``).

    Returns:
        The reason, or None for a turn to keep.
    """
    w = _words(text)
    if len(w) < cfg.min_words:
        return "short"
    if _dedup_key(text) in seen:
        return "duplicate"
    if normalise(text) in eval_index:
        return "eval"
    n = cfg.overlap_words
    if any(" ".join(w[i : i + n]) in eval_runs for i in range(len(w) - n + 1)):
        return "overlap"
    return None


@dataclass
class SelfPromptReport:
    """What :func:`self_prompts` did: prompts written, present before, dropped by reason, batches, seconds."""

    out: str
    num_written: int
    num_present: int
    dropped: dict
    batches: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        drops = ", ".join(f"{v} {k}" for k, v in sorted(self.dropped.items())) or "none"
        return (
            f"wrote {self.num_written} self-written prompts into {self.out} ({self.num_present} already "
            f"there; dropped: {drops}; {self.batches} batches, {self.seconds:.0f} s)"
        )


def self_prompts(model, tokenizer, out: str | Path, cfg: SelfPromptConfig) -> SelfPromptReport:
    """Sample user turns from the target until ``out`` (JSONL, appended) holds ``cfg.num`` prompts.

    Args:
        model: the target HF causal LM (eval mode; its device is used).
        tokenizer: its tokenizer, with a chat template.
        out: JSONL file, created or extended; a rerun resumes after the last batch written.
        cfg: :class:`SelfPromptConfig`.

    Returns:
        :class:`SelfPromptReport`.

    Raises:
        DataError: no chat template, a gzip ``out``, an unreadable record in ``out``, or
            ``cfg.max_batches`` batches without reaching ``cfg.num``.
    """
    from tqdm.auto import tqdm

    out = Path(out)
    if out.suffix == ".gz":
        raise DataError(f"{out}: self-prompts appends plain JSONL; write FILE.jsonl")
    prefix = user_turn_prefix(tokenizer, cfg.system_prompt)
    target_sha, template_sha = target_fingerprint(model, tokenizer)
    eval_index = eval_prompt_index()
    eval_runs = eval_word_runs(cfg.overlap_words, eval_index)
    seen, next_batch = set(), 0
    drop_partial_tail(out)
    if out.is_file():
        for lineno, raw in jsonl_lines(read_text(out)):
            try:
                rec = json.loads(raw)
                seen.add(_dedup_key(rec["prompt"]))
                next_batch = max(next_batch, rec["self_prompt"]["batch"] + 1)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{out}:{lineno}: not a self-written prompt record ({e})") from e
    present = len(seen)
    sampling = DistillConfig(
        batch_size=cfg.batch_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=cfg.seed,
    )
    eos = model.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    keys = ("seed", "temperature", "top_p", "max_new_tokens", "system_prompt")
    settings = {k: getattr(cfg, k) for k in keys}
    dropped: dict[str, int] = {}
    t0, batches, written = time.perf_counter(), 0, 0
    bar = tqdm(total=cfg.num, initial=min(present, cfg.num), desc="self-prompts", unit="prompt")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        while present + written < cfg.num:
            if batches >= cfg.max_batches:
                raise DataError(
                    f"{out}: {cfg.max_batches} batches gave {written} prompts of the {cfg.num - present} "
                    "wanted (the target rarely closes its user turn: raise --max-new-tokens?)"
                )
            b = next_batch + batches
            for ids in generate_answers(model, tokenizer, [prefix] * cfg.batch_size, sampling, batch_index=b):
                if not ids or ids[-1] not in stops:
                    reason = "unfinished"
                else:
                    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                    reason = drop_reason(text, seen, eval_index, eval_runs, cfg)
                if reason is not None:
                    dropped[reason] = dropped.get(reason, 0) + 1
                    continue
                if present + written >= cfg.num:
                    break
                seen.add(_dedup_key(text))
                prov = {"target": target_sha, "chat_template": template_sha, "batch": b, **settings}
                f.write(json.dumps({"prompt": text, "self_prompt": prov}) + "\n")
                written += 1
                bar.update(1)
            f.flush()
            batches += 1
    bar.close()
    return SelfPromptReport(str(out), written, present, dropped, batches, time.perf_counter() - t0)
