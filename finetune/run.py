"""Entry points: ``finetune`` (recover a converted drafter) and ``train_drafter`` (a fresh EAGLE-3
drafter for a target that has none). Paths in, a :class:`~finetune.train.report.TrainResult` out."""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune.config import FinetuneConfig
from finetune.onpolicy import chain_scorer, measure_kept, prepare_onpolicy
from finetune.train.distributed import maybe_init_distributed, world
from finetune.train.init import new_drafter_for_target, standardise_aux_input
from finetune.train.params import copy_head
from finetune.train.trainer import (
    REPORT_NAME,
    STATE_NAME,
    Trainer,
    TrainResult,
)
from slimspec_convert.atomic import atomic_write_json, working_folder
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.examples import collate, load_examples, split_heldout, token_counts
from slimspec_convert.data.records import DataStats
from slimspec_convert.model.config import default_aux_boundaries
from slimspec_convert.targets.forward import resolve_aux_layers, target_forward
from slimspec_convert.targets.load import load_target, num_target_layers
from slimspec_convert.version import __version__

logger = logging.getLogger(__name__)


def _check_out(out: Path, resume: bool, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder; --out must be a folder")
    if out.exists() and any(out.iterdir()) and not (resume or force):
        raise FileExistsError(
            f"{out}: exists and is not empty; pass --resume to continue or --force to overwrite"
        )
    if resume and not (out / STATE_NAME).is_file():
        logger.warning("%s: no %s to resume from; starting fresh", out, STATE_NAME)


def _resumable(out: Path) -> bool:
    """After a failure: keep an OUT this run created only when it holds a training state to resume."""
    return (out / STATE_NAME).is_file()


def _out_folder(out: Path):
    """OUT as a :func:`~slimspec_convert.atomic.working_folder` (locked; removed again after a failure
    unless resumable); in a multi-process run only rank 0 holds it."""
    rank = world()[0]
    return working_folder(out, keep=_resumable) if rank == 0 else contextlib.nullcontext(out)


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
    with _out_folder(out):
        model, tok = load_target(target, cfg.dtype, cfg.device)
        aux = default_aux_boundaries(num_target_layers(model))  # what new_drafter_for_target reads
        runs = _data(model, tok, aux, data, out, cfg, eval_data, self_distill)
        counts = token_counts(runs.train, int(model.config.vocab_size)) if draft_vocab_size else None
        drafter = new_drafter_for_target(model, draft_vocab_size, counts, seed=cfg.seed).to(model.device)
        if not resume or not (out / "training_state.pt").exists():  # a resumed run loads its own weights
            standardise_aux_input(drafter, *_aux_sample(model, tok, runs.train, aux))
        meta = _meta("train-drafter", str(target), data, cfg, runs.stats)
        return _run(drafter, model, tok, runs, cfg, out, resume=resume, meta=meta)


@torch.no_grad()
def _aux_sample(model, tok, examples, aux: tuple[int, ...], n: int = 8):
    """(aux [B, T, K*d], mask [B, T]) of the target on the first ``n`` training examples: what
    :func:`~finetune.train.init.standardise_aux_input` measures."""
    batch = collate(list(examples[:n]), tok.pad_token_id if tok.pad_token_id is not None else 0)
    mask = batch["attention_mask"].bool()
    out = target_forward(
        model, batch["input_ids"].to(model.device), aux, attention_mask=mask.long().to(model.device)
    )
    return out.aux_hidden.float().cpu(), mask


def train_eval(tok, examples, eval_data, cfg):
    """(training, held-out) examples: ``eval_data`` files as the held-out set, or else a seeded split
    of ``examples`` (``cfg.max_eval_fraction``, ``cfg.split_seed``)."""
    if eval_data:
        eval_ex, _ = load_examples(tok, eval_data, cfg.max_length, chat=cfg.chat)
        return examples, eval_ex
    return split_heldout(examples, cfg.max_eval_fraction, cfg.split_seed)


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
    with _out_folder(out):
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
        runs = _data(
            model, tok, resolve_aux_layers(drafter.config, model), data, out, cfg, eval_data, self_distill
        )
        meta = _meta("finetune", str(target), data, cfg, runs.stats)
        return _run(drafter, model, tok, runs, cfg, out, resume=resume, meta=meta, teacher_head=teacher_head)


@dataclass
class _RunData:
    train: list
    eval: list
    stats: DataStats
    scorer: Any = None  # the on-policy chain metric (None with data_source='human')
    heldout_prompts: list[str] = field(default_factory=list)


def _data(model, tok, aux, data, out, cfg: FinetuneConfig, eval_data, self_distill) -> _RunData:
    """Training and held-out data: on-policy (the target's answers, default) or the files' own answers."""
    if cfg.data_source == "target":
        od = prepare_onpolicy(model, tok, aux, data, out, cfg, eval_data)
        return _RunData(
            od.train, od.eval, od.stats, chain_scorer(od.onpolicy, cfg.metric_depth), od.heldout_prompts
        )
    examples, stats = load_examples(
        tok,
        data,
        cfg.max_length,
        target_model=model,
        self_distill=self_distill,
        cache_dir=out,
        max_answer_tokens=cfg.max_answer_tokens,
        chat=cfg.chat,
    )
    train_ex, eval_ex = train_eval(tok, examples, eval_data, cfg)
    return _RunData(train_ex, eval_ex, stats)


def _run(drafter, model, tok, runs: _RunData, cfg, out, *, resume, meta, teacher_head=None) -> TrainResult:
    """Build the Trainer and run it; on-policy runs add the measured tau of the initial and kept drafter."""
    aux = resolve_aux_layers(drafter.config, model)
    initial = copy.deepcopy(drafter) if runs.scorer is not None and cfg.measure_prompts else None
    trainer = Trainer(
        drafter,
        model,
        aux,
        runs.train,
        runs.eval,
        cfg,
        out,
        tok.pad_token_id,
        teacher_head=teacher_head,
        meta=meta,
        scorer=runs.scorer,
    )
    result = trainer.run(resume=resume)
    if initial is not None and trainer.rank == 0:
        prompts = runs.heldout_prompts[: cfg.measure_prompts]
        result.extra["measured"] = measure_kept(
            model, tok, initial, Path(out), prompts, cfg.metric_depth, cfg.metric_new_tokens, cfg.chat
        )
        atomic_write_json(Path(out) / REPORT_NAME, result.to_dict())
    return result
