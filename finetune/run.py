"""Entry points: ``finetune`` (recover a converted drafter) and ``train_drafter`` (a fresh EAGLE-3
drafter for a target that has none). Paths in, a :class:`~finetune.loop.TrainResult` out."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from finetune.config import FinetuneConfig
from finetune.train.init import new_drafter_for_target
from finetune.train.trainer import STATE_NAME, Trainer, TrainResult, copy_head, maybe_init_distributed
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.examples import load_examples, split_heldout, token_counts
from slimspec_convert.data.records import DataStats
from slimspec_convert.target.forward import resolve_aux_layers
from slimspec_convert.target.load import load_target
from slimspec_convert.version import __version__

logger = logging.getLogger(__name__)


def _check_out(out: Path, resume: bool, force: bool) -> None:
    if out.exists() and any(out.iterdir()) and not (resume or force):
        raise FileExistsError(
            f"{out}: exists and is not empty; pass --resume to continue or --force to overwrite"
        )
    if resume and not (out / STATE_NAME).is_file():
        logger.warning("%s: no %s to resume from; starting fresh", out, STATE_NAME)


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
    cfg: FinetuneConfig | None = None,
    *,
    draft_vocab_size: int | None = None,
    eval_data: list[str | Path] | None = None,
    resume: bool = False,
    force: bool = False,
    self_distill: bool = False,
) -> TrainResult:
    """Train a new EAGLE-3 drafter for ``target`` (``slimspec train-drafter``).

    ``cfg`` None means :meth:`FinetuneConfig.for_new_drafter` (every parameter trained, lr 1e-3).

    Raises:
        FileExistsError: OUT exists without resume/force.
        ValueError: bad config or no usable data.
    """
    out = Path(out)
    cfg = cfg if cfg is not None else FinetuneConfig.for_new_drafter()
    maybe_init_distributed()
    _check_out(out, resume, force)
    model, tok = load_target(target, cfg.dtype, cfg.device)
    examples, stats = load_examples(
        tok, data, cfg.max_length, target_model=model, self_distill=self_distill, cache_dir=out
    )
    train_ex, eval_ex = _train_eval(tok, examples, eval_data, cfg)
    counts = token_counts(train_ex, int(model.config.vocab_size)) if draft_vocab_size else None
    drafter = new_drafter_for_target(model, draft_vocab_size, counts, seed=cfg.seed).to(model.device)
    meta = _meta("train-drafter", str(target), data, cfg, stats)
    return _run(drafter, model, tok, train_ex, eval_ex, cfg, out, resume=resume, meta=meta)


def _train_eval(tok, examples, eval_data, cfg):
    if eval_data:
        eval_ex, _ = load_examples(tok, eval_data, cfg.max_length)
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

    out = Path(out)
    maybe_init_distributed()
    _check_out(out, resume, force)
    model, tok = load_target(target, cfg.dtype, cfg.device)
    drafter, _ = load_drafter(drafter_path, target=model)
    drafter = drafter.float().to(model.device)  # trained parameters stay float32 (autocast on CUDA)
    teacher_head = None
    if cfg.teacher == "drafter":
        if teacher_drafter is None:
            raise ValueError(
                "--teacher drafter needs --teacher-drafter PATH (the original full-head drafter)"
            )
        teacher, _ = load_drafter(teacher_drafter, target=model)
        teacher_head = copy_head(teacher.float().to(model.device))
    examples, stats = load_examples(
        tok, data, cfg.max_length, target_model=model, self_distill=self_distill, cache_dir=out
    )
    train_ex, eval_ex = _train_eval(tok, examples, eval_data, cfg)
    meta = _meta("finetune", str(target), data, cfg, stats)
    return _run(
        drafter, model, tok, train_ex, eval_ex, cfg, out, resume=resume, meta=meta, teacher_head=teacher_head
    )


def _run(drafter, model, tok, train_ex, eval_ex, cfg, out, *, resume, meta, teacher_head=None) -> TrainResult:
    """Check the drafter's aux layers against the target, build the Trainer and run it."""
    aux = resolve_aux_layers(drafter.config, model)
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
