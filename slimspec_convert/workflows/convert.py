"""Python API of ``slimspec inspect`` / ``slimspec convert``: load any EAGLE-3 drafter, factorise its head.

``load_drafter`` builds an :class:`~slimspec_convert.model.drafter.Eagle3Drafter` from any layout in
:mod:`slimspec_convert.checkpoint.dialects`; ``convert`` replaces the dense ``lm_head`` ``W [V_d, d]`` by
``W_up [V_d, r] @ W_down [r, d]`` (truncated SVD, SlimSpec arXiv 2605.10453 section 3; factor
names as lightseekorg/TorchSpec PR #185) and writes an HF-style folder the API loads back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slimspec_convert.atomic import atomic_write_json, claim_folder, staged_folder
from slimspec_convert.checkpoint.canonical import CanonicalTensor, LoadReport, ResolvedCheckpoint
from slimspec_convert.checkpoint.dialect_config import NORM_OUTPUT_SEMANTICS
from slimspec_convert.checkpoint.dialects import expected_shapes, resolve_checkpoint
from slimspec_convert.checkpoint.load import TargetTensors, borrow, inspect_drafter, load_drafter
from slimspec_convert.checkpoint.names import (
    CONFIG_NAME,
    D2T_KEY,
    EMBED_KEY,
    LM_HEAD_DOWN_KEY,
    LM_HEAD_KEY,
    LM_HEAD_UP_KEY,
    REPORT_NAME,
    SLIMSPEC_SECTION,
    T2D_KEY,
    WEIGHTS_NAME,
)
from slimspec_convert.checkpoint.save import hf_config_dict
from slimspec_convert.checkpoint.weightfiles import CheckpointError, write_safetensors
from slimspec_convert.devices import AUTO_DTYPE, check_device_name, check_run_dtype
from slimspec_convert.dtypes import DTYPES
from slimspec_convert.lowrank.blocks import NonFiniteError, count_nonfinite, same_rows
from slimspec_convert.lowrank.calibrated import (
    DEFAULT_CALIBRATION_DAMP,
    DEFAULT_TOKEN_WEIGHT,
    HeadCalibration,
    calibrated_factorize,
)
from slimspec_convert.lowrank.svd import (
    DEFAULT_RANDOMIZED_NITER,
    choose_method,
    choose_rank,
    head_params,
    lowrank_factorize,
    rank_from_rule,
    spectrum,
)
from slimspec_convert.version import __version__
from slimspec_convert.workflows.calibrate import (
    DEFAULT_CALIBRATION_SAMPLES,
    calibrate_from_files,
    check_calibration_source,
    default_calibration_files,
    head_row_weights,
)
from slimspec_convert.workflows.convert_report import ConvertReport
from slimspec_convert.workflows.head_rows import full_vocab_head, head_vs_target


@dataclass(frozen=True)
class ConvertConfig:
    """Options of ``slimspec convert`` (exactly one of rank, rank_fraction, energy may be set).

    With none set, the rank is ``hidden_size // DEFAULT_RANK_DIVISOR`` (r = d/8). With a ``target``
    the factors are calibrated (``calibrate``, default on) on ``calibration_data``, or on the
    built-in training slice (:func:`~slimspec_convert.workflows.calibrate.default_calibration_files`)
    when none is given, answered by the target itself (``calibration_source="target"``, on-policy:
    the text speculative decoding runs on) or with the files' own answers (``"human"``);
    ``device`` and ``calibration_dtype`` place that pass (``auto``: cuda when available, bfloat16
    there, float32 on the CPU).
    """

    rank: int | None = None
    rank_fraction: float | None = None
    energy: float | None = None
    full_vocab: bool = False
    target: str | None = None
    dtype: str | None = None
    force: bool = False
    svd: str = "auto"  # auto | exact | randomized
    seed: int = 0
    svd_niter: int = DEFAULT_RANDOMIZED_NITER
    norm_output_semantics: str = "auto"  # auto | specforge | engine (eagle3-formats.md P7)
    calibration_damp: float = DEFAULT_CALIBRATION_DAMP
    calibration_token_weight: float = DEFAULT_TOKEN_WEIGHT  # rows weighted by next-token frequency
    calibration_data: tuple[str, ...] = ()  # training-format files; needs target; () = built-in slice
    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES
    calibration_source: str = "target"  # target: the target answers the prompts (on-policy); human: files'
    calibrate: bool = True  # with a target: fit the factors to real hidden states (--no-calibration)
    device: str = "auto"  # the calibration pass
    calibration_dtype: str = AUTO_DTYPE  # the target's dtype in the calibration pass

    def __post_init__(self) -> None:
        chosen = [n for n in ("rank", "rank_fraction", "energy") if getattr(self, n) is not None]
        if len(chosen) > 1:
            raise ValueError(f"ConvertConfig: give only one of rank, rank_fraction, energy (got {chosen})")
        if self.rank is not None and self.rank <= 0:
            raise ValueError(f"ConvertConfig.rank: rank r={self.rank} must be >= 1")
        if self.rank_fraction is not None and not 0 < self.rank_fraction <= 1:
            raise ValueError(f"ConvertConfig.rank_fraction={self.rank_fraction}: expected 0 < F <= 1")
        if self.energy is not None and not 0 < self.energy <= 1:
            raise ValueError(f"ConvertConfig.energy={self.energy}: expected 0 < E <= 1")
        if self.full_vocab and not self.target:
            raise ValueError("ConvertConfig.full_vocab needs target (--target): rows come from its lm_head")
        if self.svd not in ("auto", "exact", "randomized"):
            raise ValueError(f"ConvertConfig.svd={self.svd!r}: expected auto, exact or randomized")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"ConvertConfig.dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")
        if self.energy is not None and self.svd == "randomized":
            raise ValueError("ConvertConfig: energy needs the full spectrum; use svd='exact' or 'auto'")
        if self.calibration_data and not self.target:
            raise ValueError(
                "--calibration-data needs --target (ConvertConfig.calibration_data needs target): "
                "the aux hidden states come from it"
            )
        if self.calibration_data and not self.calibrate:
            raise ValueError(
                "ConvertConfig: calibration_data with calibrate=False (--calibration-data with "
                "--no-calibration): drop one of them"
            )
        check_device_name("ConvertConfig", self.device)
        check_run_dtype("ConvertConfig.calibration_dtype", self.calibration_dtype)
        check_calibration_source("ConvertConfig.calibration_source", self.calibration_source)
        if self.calibration_samples < 1:
            raise ValueError(f"ConvertConfig.calibration_samples={self.calibration_samples}: expected >= 1")
        if not 0 <= self.calibration_token_weight <= 1:
            raise ValueError(
                f"ConvertConfig.calibration_token_weight={self.calibration_token_weight}: expected in [0, 1]"
            )
        if not self.calibration_damp > 0:
            raise ValueError(f"ConvertConfig.calibration_damp={self.calibration_damp}: expected > 0")
        if self.svd_niter < 0:
            raise ValueError(f"ConvertConfig.svd_niter={self.svd_niter}: expected >= 0")
        if self.norm_output_semantics not in NORM_OUTPUT_SEMANTICS:
            raise ValueError(
                f"ConvertConfig.norm_output_semantics={self.norm_output_semantics!r}: "
                f"expected one of {list(NORM_OUTPUT_SEMANTICS)}"
            )


__all__ = ["ConvertReport", "LoadReport", "TargetTensors", "convert", "inspect_drafter", "load_drafter"]


def convert(
    src: str | Path, out: str | Path, cfg: ConvertConfig, *, calibration: HeadCalibration | None = None
) -> ConvertReport:
    """Convert a drafter's dense lm_head into a low-rank one and write an HF-style folder.

    Output: ``OUT/config.json`` (flat ``LlamaForCausalLMEagle3`` config with ``lm_head_rank`` and a
    ``slimspec`` section holding the normalised config and the conversion), ``OUT/model.safetensors``
    (canonical keys; ``lm_head.down.weight`` [r, d] and ``lm_head.up.weight`` [rows, r] replace
    ``lm_head.weight``; every other tensor, ``d2t`` and ``t2d`` included, copied byte for byte) and
    ``OUT/slimspec_report.json``. Everything is written into a temporary folder beside OUT and
    renamed into place at the end, so a failure leaves OUT untouched.

    The SVD reads the head straight from the memory-mapped file in row blocks; the dense
    ``W_up @ W_down`` is never formed (see :func:`~slimspec_convert.lowrank.svd.lowrank_factorize`).

    ``full_vocab`` (needs ``target``): a trimmed head [V_d, d] becomes a full [V_t, d] head before
    the factorisation: row ``i + d2t[i]`` is the drafter's row i, every other row is the target's
    lm_head row, used as is, which requires the target hidden size to equal d. Trade-off: the
    vocabulary-trimming ceiling on acceptance is gone (the drafter can now propose every token),
    but the added rows were trained against the target's final hidden state, not the drafter's;
    they score well only as far as the drafter's normed hidden state imitates the target's
    (exactly for speculators heads, which are target rows, P20, loosely for heads trained from
    scratch), so a short KL fine-tune is advised. The low-rank head also spends its rank on
    V_t rows instead of V_d, and the parameter count grows with V_t.

    Args:
        src: source drafter folder (any supported layout).
        out: destination folder; must not exist unless ``cfg.force``.
        cfg: :class:`ConvertConfig` (rank rule, target, dtype, SVD method).
        calibration: the lm_head input's second moment on real data
            (:func:`slimspec_convert.workflows.calibrate.calibrate_from_files`). When this is None
            and ``cfg.target`` is set with ``cfg.calibrate`` (the default), it is computed here, on
            ``cfg.device``, from ``cfg.calibration_data`` or the built-in training slice. With it,
            the factors minimise the expected logit error instead of the weight error
            (:func:`~slimspec_convert.lowrank.calibrated.calibrated_factorize`, damping
            ``cfg.calibration_damp``);
            the rank rule still reads the plain spectrum of W. Without it the report carries a
            warning (``report.warnings``) that the plain SVD needs calibration or a fine-tune.

    Returns:
        :class:`ConvertReport`.

    Raises:
        FileExistsError: OUT exists and ``force`` is false (nothing is written).
        FileNotFoundError: the built-in calibration data is missing (a wheel install).
        ValueError: OUT is SRC; rank outside [1, min(rows, d)]; full_vocab with a target of a
            different hidden size or vocabulary; an already low-rank source head.
        CheckpointError: any bad input (see :func:`load_drafter`), NaN/inf in the head.
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    # OUT's lock is held from the first check (which repairs an interrupted earlier replace) to the
    # swap, so a second convert into the same OUT stops at once, not after its calibration
    with claim_folder(out, cfg.force) as recovered:
        return _convert(src, out, cfg, calibration, recovered, t0)


def _convert(
    src: Path,
    out: Path,
    cfg: ConvertConfig,
    calibration: HeadCalibration | None,
    recovered: list[str],
    t0: float,
) -> ConvertReport:
    """:func:`convert` with OUT claimed, in its steps: read the source head, calibrate, choose the rank,
    factorise, then write the folder and its report."""
    if src.resolve() == out.resolve():
        raise ValueError(f"{out}: the output folder is the source folder; choose another OUT")
    source = _read_source(src, cfg)
    if calibration is None and cfg.target and cfg.calibrate:  # after the cheap checks: this pass is slow
        calibration = calibrate_from_files(
            src,
            cfg.target,
            list(cfg.calibration_data or default_calibration_files()),
            samples=cfg.calibration_samples,
            device=cfg.device,
            dtype=cfg.calibration_dtype,
            source=cfg.calibration_source,
        )
    out_dtype = getattr(torch, DTYPES[cfg.dtype]) if cfg.dtype else source.W.dtype
    try:
        r, rule = _choose_rank(source, cfg)
        fac = _factorize(source, r, cfg, calibration, out_dtype)
    except NonFiniteError as e:
        raise CheckpointError(
            f"{source.head.origin} has {e.count} NaN/inf entries; the head cannot be factorised"
        ) from e
    _check_factors(out, fac.W_down, fac.W_up)
    res, tgt, W = source.res, source.tgt, source.W
    embed = res.tensors[EMBED_KEY].view() if EMBED_KEY in res.tensors else tgt.embed() if tgt else None
    is_embedding = same_rows(W, embed) if embed is not None else None  # the rerank's precondition
    new_cfg = res.config.replace(
        head_rank=r, draft_vocab_size=int(W.shape[0]), head_is_embedding=is_embedding
    )
    items = _output_items(res, new_cfg, fac.W_up, fac.W_down)
    report = _report(src, out, cfg, source, (r, rule), fac, out_dtype, calibration, recovered, is_embedding)
    _write_output(out, cfg.force, items, new_cfg, res, report, t0)
    return report


@dataclass
class _SourceHead:
    """The source drafter as convert reads it: the resolved checkpoint, the target's tensors (or None),
    the head to factorise (memory-mapped; with ``full_vocab`` the full [V_t, d] head) and notes."""

    res: ResolvedCheckpoint
    tgt: TargetTensors | None
    head: CanonicalTensor
    W: Tensor  # [rows, d]
    stats: dict
    rows_added: int
    notes: list[str]


def _read_source(src: Path, cfg: ConvertConfig) -> _SourceHead:
    """Step 1: resolve the source layout, refuse a low-rank head, borrow a head the drafter does not
    store from the target, and with ``cfg.full_vocab`` give a trimmed head every target row.

    Raises:
        ValueError: an already low-rank head; ``full_vocab`` against an unfit target.
        CheckpointError: any bad input (:func:`~slimspec_convert.checkpoint.dialects.resolve_checkpoint`).
    """
    tgt = TargetTensors.open(cfg.target) if cfg.target else None
    res = resolve_checkpoint(
        src,
        target_num_layers=tgt.num_layers if tgt else None,
        norm_output_semantics=cfg.norm_output_semantics,
    )
    dcfg = res.config
    if dcfg.head_rank is not None:
        raise ValueError(
            f"{src}: the head is already low-rank (r={dcfg.head_rank}); convert needs a dense head"
        )
    head = res.tensors.get(LM_HEAD_KEY)
    if head is None:
        head = CanonicalTensor(LM_HEAD_KEY, value=borrow(LM_HEAD_KEY, res, tgt), origin="target lm_head")
    W = head.view()  # [V_d, d], memory-mapped
    notes: list[str] = []
    stats = head_vs_target(W, res, tgt) if tgt is not None else {}
    rows_added = 0
    if cfg.full_vocab and dcfg.is_trimmed:
        W, rows_added = full_vocab_head(W, res, tgt), dcfg.vocab_size - dcfg.draft_vocab_size
    elif cfg.full_vocab:
        notes.append("full_vocab: the head already has every target row; nothing added")
    return _SourceHead(res, tgt, head, W, stats, rows_added, notes)


def _choose_rank(source: _SourceHead, cfg: ConvertConfig) -> tuple[int, str]:
    """Step 3: the rank r from the rule of ``cfg`` (``--energy``, ``--rank``, ``--rank-fraction`` or d/8)
    and the rule in words.

    Raises:
        ValueError: a rank outside [1, min(rows, d)], naming the head.
        NonFiniteError: NaN/inf in the head (``--energy`` reads its spectrum).
    """
    W, d = source.W, source.res.config.hidden_size
    if cfg.energy is not None:
        return choose_rank(spectrum(W), d, energy=cfg.energy), f"energy >= {cfg.energy}"
    try:
        r = rank_from_rule(min(W.shape), d, rank=cfg.rank, rank_fraction=cfg.rank_fraction)
    except ValueError as e:
        raise ValueError(f"{source.head.origin} [{W.shape[0]}, {W.shape[1]}]: {e}") from e
    if cfg.rank is not None:
        return r, f"--rank {cfg.rank}"
    if cfg.rank_fraction is not None:
        return r, f"--rank-fraction {cfg.rank_fraction} of d"
    return r, "default d/8"


def _factorize(
    source: _SourceHead, r: int, cfg: ConvertConfig, calibration: HeadCalibration | None, out_dtype
):
    """Step 4: the rank-r factors, calibrated when a calibration is given (the expected logit error,
    frequency-weighted rows), else the truncated SVD (``cfg.svd``: auto, exact or randomized).

    Raises:
        NonFiniteError: NaN/inf in the head.
    """
    W, res = source.W, source.res
    if calibration is not None:
        d2t = res.tensors[D2T_KEY].load() if res.config.is_trimmed else None
        weights = head_row_weights(calibration, int(W.shape[0]), d2t, cfg.calibration_token_weight)
        return calibrated_factorize(
            W,
            r,
            calibration.second_moment,
            damp=cfg.calibration_damp,
            row_weights=weights,
            out_dtype=out_dtype,
        )
    method = (
        cfg.svd
        if cfg.svd != "auto"
        else ("exact" if cfg.energy is not None else choose_method(tuple(W.shape)))
    )
    return lowrank_factorize(
        W,
        r,
        method=method,
        out_dtype=out_dtype,
        niter=cfg.svd_niter,
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def _report(src, out, cfg, source: _SourceHead, rank, fac, out_dtype, calibration, recovered, is_embedding):
    """Step 5: the :class:`ConvertReport` (its ``seconds`` is set when the folder is written)."""
    r, rule = rank
    res, W, rows_added = source.res, source.W, source.rows_added
    dcfg, d = res.config, res.config.hidden_size
    maps = (
        "dropped: full vocabulary"
        if rows_added
        else "rebuilt t2d from d2t, d2t copied"
        if T2D_KEY in res.report.rebuilt
        else "copied byte-identical"
        if dcfg.is_trimmed
        else "none (untrimmed head)"
    )
    calibrated = (
        {
            "rows": calibration.rows,
            "source": calibration.source,
            "damp": cfg.calibration_damp,
            "token_weight": cfg.calibration_token_weight if calibration.token_counts is not None else 0.0,
            "logit_relative_error": fac.logit_relative_error,
            "svd_logit_relative_error": fac.svd_logit_relative_error,
        }
        if calibration is not None
        else {}
    )
    return ConvertReport(
        source=str(src),
        out=str(out),
        source_format=res.report.source_format,
        rank=r,
        rank_rule=rule,
        hidden_size=d,
        vocab_size=int(W.shape[0]),
        source_vocab_rows=dcfg.draft_vocab_size,
        params_before=head_params(dcfg.draft_vocab_size, d, None),
        params_after=head_params(int(W.shape[0]), d, r),
        relative_error=fac.relative_error,
        energy_retained=fac.energy_retained,
        seconds=0.0,
        svd_method=fac.method,
        svd_niter=cfg.svd_niter if fac.method == "randomized" else None,
        factor_dtype=str(out_dtype).removeprefix("torch."),
        source_dtype=str(source.head.dtype).removeprefix("torch."),
        full_vocab=bool(rows_added),
        target_rows_added=rows_added,
        vocab_maps=maps,
        head_vs_target=source.stats,
        calibration=calibrated,
        notes=list(recovered) + source.notes + res.report.warnings,
        head_is_embedding=is_embedding,
        warnings=[] if calibration is not None else [_uncalibrated_warning(src, out, r, cfg)],
    )


def _check_factors(out: Path, W_down: Tensor, W_up: Tensor) -> None:
    """Refuse factors that are not finite in their storage dtype (e.g. float16 overflow), naming OUT's file.

    Raises:
        ValueError: ``{OUT}/model.safetensors: 'lm_head.down.weight' has N NaN/inf entries ...``.
    """
    for key, t in ((LM_HEAD_DOWN_KEY, W_down), (LM_HEAD_UP_KEY, W_up)):
        if bad := count_nonfinite(t):
            name = str(t.dtype).removeprefix("torch.")
            raise ValueError(
                f"{out / WEIGHTS_NAME}: '{key}' has {bad} NaN/inf entries in {name} (the head's values "
                f"overflow {name}); nothing written: convert with --dtype bfloat16 or float32"
            )


def _uncalibrated_warning(src: Path, out: Path, r: int, cfg: ConvertConfig) -> str:
    """The one line that says an uncalibrated result needs calibration or fine-tuning, and how."""
    finetune = f"slimspec finetune --target T --drafter {out} --data FILE --out {out}-ft"
    if cfg.target:  # --no-calibration
        return (
            f"{out}: plain rank-{r} SVD (--no-calibration): it accepts almost nothing before "
            f"fine-tuning (tau 1.008 for the SmolLM2 demo drafter at r = 72); run `{finetune}`"
        )
    return (
        f"{out}: plain rank-{r} SVD, not calibrated: it accepts almost nothing yet (tau 1.008 for the "
        f"SmolLM2 demo drafter at r = 72); reconvert with `slimspec convert {src} {out} --target T "
        f"--force` (calibrates on built-in training data) or run `{finetune}`"
    )


def _output_items(res: ResolvedCheckpoint, new_cfg, W_up: Tensor, W_down: Tensor) -> list[tuple[str, Any]]:
    """(name, TensorRef or tensor) in state-dict order: raw file bytes wherever possible."""
    factors = {LM_HEAD_DOWN_KEY: W_down, LM_HEAD_UP_KEY: W_up}
    items = []
    for key in expected_shapes(new_cfg):
        if key in factors:
            items.append((key, factors[key]))
        elif key in res.tensors:
            ct = res.tensors[key]
            items.append((key, ct.raw if ct.raw is not None else ct.load()))
    return items  # embed_tokens only when the source had it


def _write_output(
    out: Path, force: bool, items, new_cfg, res: ResolvedCheckpoint, report: ConvertReport, t0: float
) -> None:
    """Write everything into a temporary sibling folder, then rename it to OUT."""
    with staged_folder(out, force) as tmp:
        write_safetensors(tmp / WEIGHTS_NAME, items, {"format": "pt", "producer": f"slimspec {__version__}"})
        float_dtypes = [t.dtype for k, t in items if t.dtype.is_floating_point and k != EMBED_KEY]
        config = hf_config_dict(new_cfg, float_dtypes[0])
        config[SLIMSPEC_SECTION]["conversion"] = {
            "source": report.source,
            "source_format": report.source_format,
            "rank": report.rank,
            "rank_rule": report.rank_rule,
            "svd_method": report.svd_method,
            "full_vocab": report.full_vocab,
            "calibrated": bool(report.calibration),
            "head_is_embedding": report.head_is_embedding,
            "load_report": {k: v for k, v in res.report.to_dict().items() if k != "config"},
        }
        atomic_write_json(tmp / CONFIG_NAME, config)
        report.seconds = time.perf_counter() - t0
        atomic_write_json(tmp / REPORT_NAME, report.to_dict())
