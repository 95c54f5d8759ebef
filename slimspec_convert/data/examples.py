"""Conversations -> token ids with an assistant-only loss mask -> batches; held-out splits.

Chat rendering uses the target's own template; the loss mask marks the assistant tokens only. A
target without a chat template (a base model), or ``chat=False``, gets raw text instead
(:func:`encode_raw`): completion records ``{prefix, completion}`` always are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from slimspec_convert.data.records import (
    COMPLETION_ROLE,
    DataError,
    DataStats,
    Message,
    has_assistant,
    is_completion,
    read_conversations,
)
from slimspec_convert.data.self_distill import complete_prompts
from slimspec_convert.targets.load import resolve_chat

RAW_TURN_SEPARATOR = "\n\n"  # between the turns of a conversation rendered as raw text


def encode_raw(
    tokenizer, conv: list[Message], max_length: int, max_answer_tokens: int | None = None
) -> tuple[Tensor, Tensor, bool] | None:
    """A conversation or completion record as raw text after ``<bos>``; the answers are supervised.

    Each message is tokenised on its own (the first with the tokenizer's own special tokens, e.g.
    Gemma's ``<bos>``; the rest without) and the pieces are concatenated, so a completion's tokens
    are those of its text alone, as a completion prompt's answer is decoded. Conversation turns
    (not completion records) are joined by :data:`RAW_TURN_SEPARATOR`, unsupervised.

    Args:
        tokenizer: a HF tokenizer (no chat template needed).
        conv: messages; ``assistant`` and ``completion`` ones are supervised.
        max_length, max_answer_tokens: as :func:`encode_conversation`.

    Returns:
        (input_ids [T] int64, loss_mask [T] bool, truncated) or None when no supervised token is left.
    """
    ids: list[int] = []
    mask: list[bool] = []
    completion = is_completion(conv)
    for i, m in enumerate(conv):
        text = m["content"] if completion or i == len(conv) - 1 else m["content"] + RAW_TURN_SEPARATOR
        piece = tokenizer(text, add_special_tokens=i == 0)["input_ids"]
        supervised = m["role"] in ("assistant", COMPLETION_ROLE)
        if supervised and max_answer_tokens is not None:
            piece = piece[:max_answer_tokens]
        ids += piece
        mask += [supervised] * len(piece)
    truncated = len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None
    if max_answer_tokens is not None:
        end = max(i for i, v in enumerate(mask) if v) + 1
        ids, mask = ids[:end], mask[:end]
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool), truncated


logger = logging.getLogger(__name__)


def encode_conversation(
    tokenizer,
    conv: list[Message],
    max_length: int,
    max_answer_tokens: int | None = None,
    chat: bool | None = None,
) -> tuple[Tensor, Tensor, bool] | None:
    """Render with the tokenizer's chat template and mark assistant tokens.

    Completion records, and every conversation when the prompt mode is completion (``chat``, as
    :func:`~slimspec_convert.targets.load.resolve_chat` decides it), go to :func:`encode_raw`.

    The rendered text of each prefix must be a prefix of the whole rendering (true of
    ChatML/Llama/Qwen templates); assistant tokens are located by character offsets of one
    tokenisation of the whole text, so token boundaries are never split.

    Args:
        tokenizer: a fast HF tokenizer with a chat template.
        conv: messages.
        max_length: truncate to this many tokens.
        max_answer_tokens: supervise only the first N tokens of each assistant turn (None: all);
            the sequence then ends at the last supervised token. Unlike cutting the answer's text,
            no end-of-turn token is added where the answer did not end.
        chat: True = chat template, False = raw text, None = the tokenizer decides.

    Returns:
        (input_ids [T] int64, loss_mask [T] bool, truncated) or None when no assistant token is left;
        ``truncated`` counts only the ``max_length`` cut.

    Raises:
        DataError: the chat template renders a prefix that is not a prefix of the whole.
        ValueError: chat=True with a tokenizer without a chat template.
    """
    if is_completion(conv) or not resolve_chat(tokenizer, chat).chat:
        return encode_raw(tokenizer, conv, max_length, max_answer_tokens)
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
        turn = (starts >= a) & (starts < b)
        if max_answer_tokens is not None:
            turn &= turn.cumsum(0) <= max_answer_tokens
        mask |= turn
    if max_answer_tokens is not None and bool(mask.any()):
        end = int(mask.nonzero()[-1]) + 1
        ids, mask = ids[:end], mask[:end]
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
    tokenizer,
    convs: list[list[Message]],
    max_length: int,
    stats: DataStats | None = None,
    max_answer_tokens: int | None = None,
    chat: bool | None = None,
) -> list[Example]:
    """Encode every conversation with an assistant turn; count the rest as skipped.

    ``max_answer_tokens``, ``chat``: see :func:`encode_conversation`.
    """
    stats = stats if stats is not None else DataStats()
    out = []
    for conv in convs:
        if not has_assistant(conv):
            stats.skipped_no_assistant += 1
            continue
        enc = encode_conversation(tokenizer, conv, max_length, max_answer_tokens, chat)
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
    epoch, k = divmod(step, max(1, num_examples // batch_size))
    return _batch_of(_epoch_order(num_examples, seed, epoch), batch_size, k)


def drawn_indices(num_examples: int, batch_size: int, batches: int, seed: int) -> list[int]:
    """The distinct example indices of global batches ``0 .. batches - 1``, sorted.

    Equal to the union of :func:`batch_indices` over those batches, with one permutation per epoch.
    """
    if num_examples <= 0:
        raise DataError("no training examples left after filtering")
    per_epoch = max(1, num_examples // batch_size)
    drawn: set[int] = set()
    for epoch in range(-(-batches // per_epoch)):
        order = _epoch_order(num_examples, seed, epoch)
        for k in range(min(per_epoch, batches - epoch * per_epoch)):
            drawn.update(_batch_of(order, batch_size, k))
        if len(drawn) == num_examples:
            break
    return sorted(drawn)


def _epoch_order(num_examples: int, seed: int, epoch: int) -> Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=g)


def _batch_of(perm: Tensor, batch_size: int, k: int) -> list[int]:
    idx = perm[k * batch_size : (k + 1) * batch_size].tolist()
    while len(idx) < batch_size:  # fewer examples than one batch
        idx += perm[: batch_size - len(idx)].tolist()
    return idx


def token_counts(examples: list[Example], vocab_size: int) -> Tensor:
    """[V_t] int64 counts of supervised (loss-masked) tokens, for building a draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for e in examples:
        counts += torch.bincount(e.input_ids[e.loss_mask], minlength=vocab_size)
    return counts


def load_examples(
    tokenizer,
    data: list[str | Path],
    max_length: int,
    *,
    target_model=None,
    self_distill: bool = False,
    cache_dir: Path | None = None,
    max_new_tokens: int = 256,
    max_answer_tokens: int | None = None,
    chat: bool | None = None,
) -> tuple[list[Example], DataStats]:
    """Read, optionally complete (self-distillation) and tokenise training files.

    Args:
        tokenizer: the target's tokenizer (chat template).
        data: JSONL/JSON files in any format :func:`read_conversations` reads.
        max_length: tokens kept per conversation.
        target_model, self_distill, cache_dir, max_new_tokens: let the target answer prompt-only
            records (cached in ``cache_dir``).
        max_answer_tokens: supervise only each answer's first N tokens (:func:`encode_conversation`).
        chat: chat template, raw text or the tokenizer's choice (:func:`encode_conversation`).

    Returns:
        (examples, stats).

    Raises:
        ValueError: no usable conversation (with the counts of what was skipped), bad data lines.
    """
    stats = DataStats()
    convs = read_conversations(list(data), stats)
    if self_distill:
        if target_model is None or cache_dir is None:
            raise ValueError("self-distillation needs the target model and a cache folder")
        convs = complete_prompts(
            target_model, tokenizer, convs, cache_dir / "self_distill.jsonl", max_new_tokens=max_new_tokens
        )
    examples = build_examples(tokenizer, convs, max_length, stats, max_answer_tokens, chat)
    if not examples:
        raise ValueError(f"{', '.join(map(str, data))}: no usable conversation ({stats.summary()})")
    logger.info("data: %s", stats.summary())
    return examples, stats


def split_heldout(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Deterministic train / held-out split (at least one held-out example)."""
    g = torch.Generator().manual_seed(seed + 7)
    perm = torch.randperm(len(examples), generator=g).tolist()
    n_eval = max(1, int(len(examples) * fraction))
    if n_eval >= len(examples):
        raise ValueError(f"only {len(examples)} examples: too few to hold some out for evaluation")
    return [examples[i] for i in perm[n_eval:]], [examples[i] for i in perm[:n_eval]]
