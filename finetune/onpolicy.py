"""The on-policy recipe: train on the target's own answers, select by a metric that tracks generation.

:func:`prepare_onpolicy` splits the prompts of ``--data`` into held-out prompts (never trained on)
and training prompts, lets the target answer as many training prompts as the run will consume
(:func:`slimspec_convert.data.distill.distill`, cached in ``OUT/distilled.jsonl``, resumable), and
builds the held-out on-policy set on which every evaluation scores the drafter's predicted greedy
chain tau (:mod:`slimspec_convert.measure.chain_acceptance`). :func:`measure_kept` decodes a few
held-out prompts with the initial and the kept drafter (real speculative decoding) for the report.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from finetune.config import FinetuneConfig
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.distill import PROMPT_ROLES, DistillConfig, distill, is_distilled, read_prompts
from slimspec_convert.data.examples import Example, build_examples
from slimspec_convert.data.records import DataError, DataStats, read_conversations
from slimspec_convert.measure.chain_acceptance import (
    OnPolicyEval,
    build_onpolicy_eval,
    chain_acceptance,
    measured_chain_tau,
)
from slimspec_convert.model.drafter import Eagle3Drafter

logger = logging.getLogger(__name__)

DISTILLED_NAME = "distilled.jsonl"


@dataclass
class OnPolicyData:
    """What the on-policy recipe trains and scores on.

    Attributes:
        train: tokenised distilled conversations (the target's answers to training prompts).
        eval: the held-out prompts with the target's answers, as examples (teacher-forced metrics).
        onpolicy: the held-out set the chain metric is computed on.
        stats: data counts (training conversations).
        heldout_prompts: the held-out user prompts.
    """

    train: list[Example]
    eval: list[Example]
    onpolicy: OnPolicyEval
    stats: DataStats
    heldout_prompts: list[str]


def _first_user(conv) -> str:
    return " ".join(next((m["content"] for m in conv if m["role"] in PROMPT_ROLES), "").split())


def _split_prompts(prompts: list, n_heldout: int, seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed + 11)
    perm = torch.randperm(len(prompts), generator=g).tolist()
    if len(prompts) <= n_heldout:
        raise DataError(f"{len(prompts)} prompts: need more than metric_prompts={n_heldout} (held out)")
    held = [prompts[i] for i in perm[:n_heldout]]
    return [prompts[i] for i in perm[n_heldout:]], held


def prepare_onpolicy(
    model,
    tokenizer,
    aux_layers: tuple[int, ...],
    data: list[str | Path],
    out: Path,
    cfg: FinetuneConfig,
    eval_data: list[str | Path] | None = None,
) -> OnPolicyData:
    """Distil the training prompts (cached), hold prompts out, build the on-policy metric set.

    Args:
        model, tokenizer: the target.
        aux_layers: the boundaries the drafter reads (``resolve_aux_layers``).
        data: prompt or conversation files (only their user turns are used), or files written by
            ``slimspec distill`` (used as they are; held-out prompts then come from ``eval_data`` or
            a split of their prompts).
        out: the run folder (``OUT/distilled.jsonl`` caches the target's answers).
        cfg: ``metric_prompts``, ``distill_new_tokens``, ``steps * batch_size * grad_accum``
            (prompts the run consumes), ``seed``.
        eval_data: held-out prompt files (default: a seeded split of ``data``'s prompts).

    Returns:
        :class:`OnPolicyData`.

    Raises:
        DataError: benchmark prompts among the sources, too few prompts, no usable conversation.
    """
    prompts = read_prompts(list(data))
    if eval_data:
        train_prompts, held = prompts, read_prompts(list(eval_data))[: cfg.metric_prompts]
    else:
        train_prompts, held = _split_prompts(prompts, cfg.metric_prompts, cfg.split_seed)
    held_texts = [r.messages[-1][1] for r in held]
    if is_distilled(list(data)):
        files = list(data)
    else:
        needed = cfg.steps * cfg.batch_size * cfg.grad_accum
        keys = {(r.source, r.line) for r in train_prompts[:needed]}
        dcfg = DistillConfig(max_new_tokens=cfg.distill_new_tokens, chat=cfg.chat)
        rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if rank0:  # one writer; the other ranks read the finished file
            distill(model, tokenizer, list(data), out / DISTILLED_NAME, dcfg, only=keys)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        files = [out / DISTILLED_NAME]
    stats = DataStats()
    convs = read_conversations(files, stats)
    held_set = {" ".join(t.split()) for t in held_texts}
    convs = [c for c in convs if _first_user(c) not in held_set]
    train = build_examples(tokenizer, convs, cfg.max_length, stats, cfg.max_answer_tokens, cfg.chat)
    if not train:
        raise DataError(f"{', '.join(map(str, files))}: no usable distilled conversation ({stats.summary()})")
    ev = build_onpolicy_eval(
        model, tokenizer, held_texts, aux_layers, max_new_tokens=cfg.metric_new_tokens, chat=cfg.chat
    )
    ends = ev.answer_mask.long().cumsum(1).argmax(1) + 1  # [N] one past the last answer token
    eval_examples = [
        Example(ev.input_ids[n, : int(e)], ev.answer_mask[n, : int(e)]) for n, e in enumerate(ends.tolist())
    ]
    logger.info("on-policy data: %d training conversations, %d held-out prompts", len(train), len(held_texts))
    return OnPolicyData(train, eval_examples, ev, stats, held_texts)


def chain_scorer(ev: OnPolicyEval, depth: int):
    """The trainer's selection score: predicted greedy chain tau on the held-out on-policy set."""

    def score(drafter: Eagle3Drafter):
        return chain_acceptance(drafter, ev, depth)

    return score


def measure_kept(
    model,
    tokenizer,
    initial: Eagle3Drafter,
    out: Path,
    prompts: list[str],
    depth: int,
    max_new_tokens: int,
    chat: bool | None = None,
) -> dict:
    """Real greedy chain decoding of held-out ``prompts`` with the initial and the kept drafter.

    Returns:
        ``{"depth", "num_prompts", "initial_tau", "kept_tau"}`` (tokens committed per verification).
    """
    kept, _ = load_drafter(out, target=model)
    taus = [
        measured_chain_tau(model, tokenizer, d.float().eval(), prompts, depth, max_new_tokens, chat)
        for d in (initial, kept)
    ]
    return {"depth": depth, "num_prompts": len(prompts), "initial_tau": taus[0], "kept_tau": taus[1]}
