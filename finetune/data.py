"""Training data: files -> conversations -> token ids with an assistant-only loss mask -> batches.

Accepted record formats (``.jsonl`` one record per line, or ``.json`` holding an array):

* OpenAI ``{"messages": [{"role", "content"}, ...]}``
* ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``
* GSM8K ``{"question", "answer"}``; GPTeacher ``{"instruction", "input", "response"}``;
  Self-Instruct ``{"instruction", "instances": [{"input", "output"}]}`` (one conversation per instance)
* OpenAssistant trees ``{"prompt": {"role": "prompter", "text", "replies": [...]}}`` (every
  root-to-leaf path is a conversation)
* prompts only: a bare JSON string, ``{"prompt": str}`` or MT-Bench ``{"turns": [...]}``; these have
  no assistant turn and are either completed by the target (self-distillation) or skipped and counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

Message = dict[str, str]
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


class DataError(ValueError):
    """Unusable training data; the message names the file and line."""


@dataclass
class DataStats:
    """Counts of what was read, kept and skipped (reported at the end of data loading)."""

    records: int = 0
    conversations: int = 0
    kept: int = 0
    skipped_no_assistant: int = 0
    skipped_empty: int = 0
    truncated: int = 0
    supervised_tokens: int = 0
    files: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line of counts."""
        return (
            f"{self.records} records -> {self.conversations} conversations, kept {self.kept}, "
            f"skipped {self.skipped_no_assistant} without an assistant turn and {self.skipped_empty} empty, "
            f"truncated {self.truncated}; {self.supervised_tokens} supervised tokens"
        )


def _read_records(path: Path) -> Iterator[tuple[int, object]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: data file not found")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from e
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold an array of records")
        yield from ((i + 1, rec) for i, rec in enumerate(data))
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from e


def _oasst_paths(node: dict, prefix: list[Message]) -> Iterator[list[Message]]:
    msg = {"role": ROLE_MAP.get(node.get("role", ""), "user"), "content": node.get("text", "")}
    convo = prefix + [msg]
    replies = [r for r in node.get("replies", []) if not r.get("deleted")]
    if not replies:
        yield convo
    for r in replies:
        yield from _oasst_paths(r, convo)


def record_to_conversations(rec: object, where: str) -> list[list[Message]]:
    """Normalise one record of any accepted format into OpenAI-style message lists.

    Raises:
        DataError: unknown record shape (message names ``where`` = file:line).
    """
    if isinstance(rec, str):
        return [[{"role": "user", "content": rec}]]
    if not isinstance(rec, dict):
        raise DataError(f"{where}: record is a {type(rec).__name__}, expected an object or a string")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in msgs
        ):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return [[{"role": ROLE_MAP.get(m["role"], m["role"]), "content": str(m["content"])} for m in msgs]]
    if "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list) or not all(
            isinstance(m, dict) and "from" in m and "value" in m for m in conv
        ):
            raise DataError(f"{where}: 'conversations' must be a list of {{from, value}} objects")
        return [[{"role": ROLE_MAP.get(m["from"], "user"), "content": str(m["value"])} for m in conv]]
    if "question" in rec and "answer" in rec:
        return [
            [{"role": "user", "content": rec["question"]}, {"role": "assistant", "content": rec["answer"]}]
        ]
    if "instruction" in rec and "response" in rec:
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        return [[{"role": "user", "content": user}, {"role": "assistant", "content": rec["response"]}]]
    if "instruction" in rec and "instances" in rec:
        out = []
        for inst in rec["instances"]:
            user = rec["instruction"] + (f"\n\n{inst['input']}" if inst.get("input") else "")
            out.append(
                [{"role": "user", "content": user}, {"role": "assistant", "content": inst.get("output", "")}]
            )
        return out
    if "prompt" in rec and isinstance(rec["prompt"], dict):
        return list(_oasst_paths(rec["prompt"], []))
    if "prompt" in rec and isinstance(rec["prompt"], str):
        return [[{"role": "user", "content": rec["prompt"]}]]
    if "turns" in rec and isinstance(rec["turns"], list) and rec["turns"]:
        return [[{"role": "user", "content": str(rec["turns"][0])}]]
    raise DataError(f"{where}: unknown record format with keys {sorted(rec)[:8]}")


def read_conversations(paths: list[str | Path], stats: DataStats | None = None) -> list[list[Message]]:
    """All conversations of the given files, in file order.

    Raises:
        FileNotFoundError: a missing file.
        DataError: empty file, malformed line, unknown record shape (names file:line).
    """
    stats = stats if stats is not None else DataStats()
    out: list[list[Message]] = []
    for p in paths:
        path = Path(p)
        stats.files.append(str(path))
        for lineno, rec in _read_records(path):
            stats.records += 1
            convs = record_to_conversations(rec, f"{path}:{lineno}")
            stats.conversations += len(convs)
            out.extend(convs)
    return out


def has_assistant(conv: list[Message]) -> bool:
    """True when some message has role ``assistant``."""
    return any(m["role"] == "assistant" for m in conv)


def encode_conversation(
    tokenizer, conv: list[Message], max_length: int
) -> tuple[Tensor, Tensor, bool] | None:
    """Render with the tokenizer's chat template and mark assistant tokens.

    The rendered text of each prefix must be a prefix of the whole rendering (true of
    ChatML/Llama/Qwen templates); assistant tokens are located by character offsets of one
    tokenisation of the whole text, so token boundaries are never split.

    Args:
        tokenizer: a fast HF tokenizer with a chat template.
        conv: messages.
        max_length: truncate to this many tokens.

    Returns:
        (input_ids [T] int64, loss_mask [T] bool, truncated) or None when no assistant token is left.

    Raises:
        DataError: the chat template renders a prefix that is not a prefix of the whole.
    """
    full = tokenizer.apply_chat_template(conv, tokenize=False)
    spans = []
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = (
            tokenizer.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True) if i else ""
        )
        upto = tokenizer.apply_chat_template(conv[: i + 1], tokenize=False)
        if not full.startswith(upto) or not upto.startswith(before):
            raise DataError("chat template is not prefix-stable; cannot locate assistant tokens")
        spans.append((len(before), len(upto)))
    if not spans:
        return None
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
    starts = torch.tensor([o[0] for o in enc["offset_mapping"]], dtype=torch.int64)
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    truncated = ids.numel() > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not bool(mask.any()):
        return None
    return ids, mask, truncated


@dataclass
class Example:
    """One tokenised conversation: ``input_ids`` [T] int64, ``loss_mask`` [T] bool."""

    input_ids: Tensor
    loss_mask: Tensor


def build_examples(
    tokenizer, convs: list[list[Message]], max_length: int, stats: DataStats | None = None
) -> list[Example]:
    """Encode every conversation with an assistant turn; count the rest as skipped."""
    stats = stats if stats is not None else DataStats()
    out = []
    for conv in convs:
        if not has_assistant(conv):
            stats.skipped_no_assistant += 1
            continue
        enc = encode_conversation(tokenizer, conv, max_length)
        if enc is None:
            stats.skipped_empty += 1
            continue
        ids, mask, truncated = enc
        stats.truncated += int(truncated)
        stats.kept += 1
        stats.supervised_tokens += int(mask.sum())
        out.append(Example(ids, mask))
    return out


def collate(examples: list[Example], pad_id: int) -> dict[str, Tensor]:
    """Right-pad a list of examples.

    Returns:
        ``input_ids`` [B, T] int64, ``loss_mask`` [B, T] bool, ``attention_mask`` [B, T] int64.
    """
    T = max(e.input_ids.numel() for e in examples)
    B = len(examples)
    ids = torch.full((B, T), pad_id, dtype=torch.int64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    attn = torch.zeros(B, T, dtype=torch.int64)
    for i, e in enumerate(examples):
        n = e.input_ids.numel()
        ids[i, :n] = e.input_ids
        mask[i, :n] = e.loss_mask
        attn[i, :n] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Example indices of global batch ``step`` (deterministic: a fresh permutation per epoch).

    The same (num_examples, batch_size, step, seed) always gives the same batch, which makes
    ``--resume`` exact.
    """
    if num_examples <= 0:
        raise DataError("no training examples left after filtering")
    per_epoch = max(1, num_examples // batch_size)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_examples, generator=g)
    idx = perm[k * batch_size : (k + 1) * batch_size].tolist()
    while len(idx) < batch_size:  # fewer examples than one batch
        idx += perm[: batch_size - len(idx)].tolist()
    return idx


def complete_prompts(
    model,
    tokenizer,
    convs: list[list[Message]],
    cache_path: Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
) -> list[list[Message]]:
    """Self-distillation: let the target answer prompt-only conversations (greedy, batched).

    Answers are cached in ``cache_path`` (JSONL keyed by a hash of the rendered prompt), so a
    re-run or a resumed run regenerates nothing.

    Args:
        model: target HF causal LM.
        tokenizer: its tokenizer (chat template).
        convs: conversations; those without an assistant turn are completed.
        cache_path: JSONL cache file.
        max_new_tokens: answer length cap.
        batch_size: prompts per ``generate`` call (left padding).

    Returns:
        The conversations, each prompt-only one followed by the target's answer.
    """
    from tqdm.auto import tqdm

    cache: dict[str, str] = {}
    if cache_path.is_file():
        for line in cache_path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                cache[rec["key"]] = rec["answer"]
    todo = []
    keys = []
    for conv in convs:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        key = hashlib.sha256(text.encode()).hexdigest()[:24]
        keys.append(key)
        if not has_assistant(conv) and key not in cache:
            todo.append((key, text))
    if todo:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        try:
            with open(cache_path, "a") as f:
                for i in tqdm(range(0, len(todo), batch_size), desc="self-distill", unit="batch"):
                    chunk = todo[i : i + batch_size]
                    enc = tokenizer(
                        [t for _, t in chunk], return_tensors="pt", padding=True, add_special_tokens=False
                    )
                    with torch.no_grad():
                        out = model.generate(
                            **enc,
                            max_new_tokens=max_new_tokens,
                            do_sample=False,
                            pad_token_id=tokenizer.pad_token_id,
                        )
                    for (key, _), row in zip(chunk, out[:, enc["input_ids"].shape[1] :], strict=True):
                        answer = tokenizer.decode(row, skip_special_tokens=True)
                        cache[key] = answer
                        f.write(json.dumps({"key": key, "answer": answer}) + "\n")
                    f.flush()
        finally:
            tokenizer.padding_side = side
    return [
        conv if has_assistant(conv) else conv + [{"role": "assistant", "content": cache[key]}]
        for conv, key in zip(convs, keys, strict=True)
    ]


def token_counts(examples: list[Example], vocab_size: int) -> Tensor:
    """[V_t] int64 counts of supervised (loss-masked) tokens, for building a draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for e in examples:
        counts += torch.bincount(e.input_ids[e.loss_mask], minlength=vocab_size)
    return counts
