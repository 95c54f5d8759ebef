"""Entry points: ``finetune`` (recover a converted drafter) and ``train_drafter`` (a fresh EAGLE-3
drafter for a target that has none). Paths in, a :class:`~finetune.loop.TrainResult` out."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimspec_convert import __version__
from slimspec_convert.config import DrafterConfig, default_aux_boundaries
from slimspec_convert.drafter import Eagle3Drafter
from slimspec_convert.target import (
    check_aux_layers,
    load_target,
    num_target_layers,
    target_embeddings,
    target_lm_head,
)
from slimspec_convert.vocab import draft_to_target_ids, trimmed_vocab_from_counts

from .config import FinetuneConfig
from .data import DataStats, Example, build_examples, complete_prompts, read_conversations, token_counts
from .loop import STATE_NAME, Trainer, TrainResult, copy_head, maybe_init_distributed

logger = logging.getLogger(__name__)


def _check_out(out: Path, resume: bool, force: bool) -> None:
    if out.exists() and any(out.iterdir()) and not (resume or force):
        raise FileExistsError(
            f"{out}: exists and is not empty; pass --resume to continue or --force to overwrite"
        )
    if resume and not (out / STATE_NAME).is_file():
        logger.warning("%s: no %s to resume from; starting fresh", out, STATE_NAME)


def load_examples(
    tokenizer,
    data: list[str | Path],
    cfg: FinetuneConfig,
    *,
    target_model=None,
    self_distill: bool = False,
    cache_dir: Path | None = None,
    max_new_tokens: int = 256,
) -> tuple[list[Example], DataStats]:
    """Read, optionally complete (self-distillation) and tokenise training files."""
    stats = DataStats()
    convs = read_conversations(list(data), stats)
    if self_distill:
        if target_model is None or cache_dir is None:
            raise ValueError("self-distillation needs the target model and a cache folder")
        convs = complete_prompts(
            target_model, tokenizer, convs, cache_dir / "self_distill.jsonl", max_new_tokens=max_new_tokens
        )
    examples = build_examples(tokenizer, convs, cfg.max_length, stats)
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


def new_drafter_for_target(
    target_model, draft_vocab_size: int | None = None, counts: torch.Tensor | None = None, seed: int = 0
) -> Eagle3Drafter:
    """A fresh EAGLE-3 drafter shaped after the target (one decoder layer of the target's geometry).

    Initialisation: embeddings and lm_head from the target (rows ``d2t`` + arange when trimmed);
    ``fc`` picks the highest aux state (``[0 | 0 | I]``), so before any training the drafter is a
    logit lens on layer ``L-3`` (final norm copied from the target); the decoder layer is random
    (std 0.02) with its output projections zeroed, so it starts as the identity on the residual stream.

    Args:
        target_model: HF causal LM (Llama-family geometry).
        draft_vocab_size: trimmed draft vocabulary size, or None for the full vocabulary.
        counts: [V_t] token counts used to pick the kept ids when trimmed.
        seed: initialisation seed.

    Returns:
        The drafter, float32, with ``aux_layer_ids`` = the upstream default boundaries.
    """
    tc = target_model.config
    V = int(tc.vocab_size)
    L = num_target_layers(target_model)
    rope = getattr(tc, "rope_parameters", None) or {}
    cfg = DrafterConfig(
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        num_attention_heads=int(tc.num_attention_heads),
        num_key_value_heads=int(tc.num_key_value_heads),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads),
        vocab_size=V,
        draft_vocab_size=draft_vocab_size or V,
        aux_layer_ids=default_aux_boundaries(L),
        rms_norm_eps=float(tc.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
        max_position_embeddings=int(tc.max_position_embeddings),
        source_format="slimspec-train-drafter",
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    d = cfg.hidden_size
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            else:
                p.fill_(1.0)
        drafter.midlayer.self_attn.o_proj.weight.zero_()
        drafter.midlayer.mlp.down_proj.weight.zero_()
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, 2 * d : 3 * d] = torch.eye(d)
        drafter.embed_tokens.weight.copy_(target_embeddings(target_model).float())
        target_norm = getattr(getattr(target_model, "model", None), "norm", None)
        if target_norm is not None and tuple(target_norm.weight.shape) == (d,):
            drafter.norm.weight.copy_(target_norm.weight.float())  # logit lens uses the target's final norm
        head = target_lm_head(target_model).float()
        if cfg.is_trimmed:
            if counts is None:
                raise ValueError("a trimmed draft vocabulary needs token counts")
            d2t, t2d = trimmed_vocab_from_counts(counts, cfg.draft_vocab_size)
            drafter.d2t.copy_(d2t)
            drafter.t2d.copy_(t2d)
            head = head[draft_to_target_ids(d2t)]
        drafter.lm_head.weight.copy_(head)
    return drafter


def _meta(kind: str, target: str, data: list, cfg: FinetuneConfig, stats: DataStats) -> dict[str, Any]:
    return {
        "kind": kind,
        "target": str(target),
        "data": [str(d) for d in data],
        "slimspec_version": __version__,
        "data_stats": stats.summary(),
        "seed": cfg.seed,
    }


def train_drafter(
    target: str | Path,
    data: list[str | Path],
    out: str | Path,
    cfg: FinetuneConfig,
    *,
    draft_vocab_size: int | None = None,
    eval_data: list[str | Path] | None = None,
    resume: bool = False,
    force: bool = False,
    self_distill: bool = False,
) -> TrainResult:
    """Train a new EAGLE-3 drafter for ``target`` (``slimspec train-drafter``).

    Raises:
        FileExistsError: OUT exists without resume/force.
        ValueError: bad config or no usable data.
    """
    out = Path(out)
    maybe_init_distributed()
    _check_out(out, resume, force)
    model, tok = load_target(target)
    examples, stats = load_examples(
        tok, data, cfg, target_model=model, self_distill=self_distill, cache_dir=out
    )
    train_ex, eval_ex = _train_eval(tok, examples, eval_data, cfg)
    counts = token_counts(train_ex, int(model.config.vocab_size)) if draft_vocab_size else None
    drafter = new_drafter_for_target(model, draft_vocab_size, counts, seed=cfg.seed)
    meta = _meta("train-drafter", str(target), data, cfg, stats)
    return _run(drafter, model, tok, train_ex, eval_ex, cfg, out, resume=resume, meta=meta)


def _train_eval(tok, examples, eval_data, cfg):
    if eval_data:
        eval_ex, _ = load_examples(tok, eval_data, cfg)
        return examples, eval_ex
    return split_heldout(examples, cfg.max_eval_fraction, cfg.seed)


def finetune(
    target: str | Path,
    drafter_path: str | Path,
    data: list[str | Path],
    out: str | Path,
    cfg: FinetuneConfig,
    *,
    eval_data: list[str | Path] | None = None,
    teacher_drafter: str | Path | None = None,
    resume: bool = False,
    force: bool = False,
    self_distill: bool = False,
) -> TrainResult:
    """Recover a converted (low-rank) drafter with a short KL fine-tune (``slimspec finetune``).

    Args:
        target: target model folder / GGUF / hub id.
        drafter_path: the drafter to fine-tune (any layout the loader reads).
        data: training files.
        out: output folder: best drafter (HF layout), ``training_state.pt``, logs, report.
        cfg: run config.
        eval_data: held-out files (default: a split of ``data``).
        teacher_drafter: the original full-head drafter, for ``cfg.teacher == 'drafter'``.
        resume: continue from ``OUT/training_state.pt``.
        force: allow a non-empty OUT.
        self_distill: complete prompt-only records with the target first.

    Raises:
        FileExistsError, FileNotFoundError, ValueError: bad paths, config or data.
    """
    from slimspec_convert.convert import load_drafter

    out = Path(out)
    maybe_init_distributed()
    _check_out(out, resume, force)
    model, tok = load_target(target)
    drafter, _ = load_drafter(drafter_path, target=model)
    drafter = drafter.float()
    teacher_head = None
    if cfg.teacher == "drafter":
        if teacher_drafter is None:
            raise ValueError(
                "--teacher drafter needs --teacher-drafter PATH (the original full-head drafter)"
            )
        teacher, _ = load_drafter(teacher_drafter, target=model)
        teacher_head = copy_head(teacher.float())
    examples, stats = load_examples(
        tok, data, cfg, target_model=model, self_distill=self_distill, cache_dir=out
    )
    train_ex, eval_ex = _train_eval(tok, examples, eval_data, cfg)
    meta = _meta("finetune", str(target), data, cfg, stats)
    return _run(
        drafter, model, tok, train_ex, eval_ex, cfg, out, resume=resume, meta=meta, teacher_head=teacher_head
    )


def _run(drafter, model, tok, train_ex, eval_ex, cfg, out, *, resume, meta, teacher_head=None) -> TrainResult:
    """Check the drafter's aux layers against the target, build the Trainer and run it."""
    aux = drafter.config.resolved_aux_layer_ids(num_target_layers(model))
    check_aux_layers(aux, num_target_layers(model))
    trainer = Trainer(
        drafter,
        model,
        aux,
        train_ex,
        eval_ex,
        cfg,
        out,
        tok.pad_token_id,
        teacher_head=teacher_head,
        meta=meta,
    )
    return trainer.run(resume=resume)
