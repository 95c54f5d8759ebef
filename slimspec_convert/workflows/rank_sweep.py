"""Automatic rank choice: sweep ranks, measure offline acceptance and head latency, apply the cost model.

For each rank r the drafter's trained head ``W [V_d, d]`` is replaced by its truncated SVD (the
factors of rank r are the leading r directions of one factorisation), and we measure

* SVD error and retained energy (from the exact spectrum);
* offline expected acceptance on held-out data: at every position whose next-next token is an
  assistant token, the drafter's step-0 distribution ``q`` is compared with the target's next-token
  distribution ``p`` by ``sum_v min(p_v, q_v)`` (the acceptance probability of speculative sampling,
  Leviathan et al. 2023, Theorem 3.5), plus top-1 agreement (greedy acceptance);
* head latency (batch 1, interleaved with the full head, same run).

Acceptance alpha becomes tau with the chain model (:func:`~slimspec_convert.lowrank.costmodel.expected_tau`),
and the rank with the best predicted ``rho_TPS`` is recommended (:mod:`slimspec_convert.lowrank.costmodel`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from finetune.config import FinetuneConfig
from finetune.train.trainer import Trainer
from slimspec_convert.atomic import atomic_write_bytes, atomic_write_json
from slimspec_convert.checkpoint.load import load_drafter_with_target_embeddings
from slimspec_convert.data.examples import build_examples, collate, load_examples
from slimspec_convert.data.records import read_conversations
from slimspec_convert.devices import AUTO_DTYPE, check_device_name, check_run_dtype
from slimspec_convert.lowrank.calibrated import DEFAULT_TOKEN_WEIGHT, HeadCalibration, calibrated_factorize
from slimspec_convert.lowrank.costmodel import RankCandidate, expected_tau, recommend_rank
from slimspec_convert.lowrank.svd import lowrank_factorize, spectrum
from slimspec_convert.measure.acceptance import expected_acceptance_by_head
from slimspec_convert.measure.head_latency import DEFAULT_BENCH_REPEATS, DEFAULT_BENCH_WARMUP, resolve_ranks
from slimspec_convert.measure.kappa import KappaMeasurement, measure_kappa
from slimspec_convert.measure.plots import plot_rank_vs_acceptance, plot_rank_vs_latency
from slimspec_convert.measure.timing import time_module_calls
from slimspec_convert.model.drafter import Eagle3Drafter, with_head
from slimspec_convert.model.head import LowRankHead
from slimspec_convert.targets.forward import resolve_aux_layers
from slimspec_convert.targets.load import load_target
from slimspec_convert.version import __version__
from slimspec_convert.workflows.calibrate import (
    DEFAULT_CALIBRATION_SAMPLES,
    calibrate_from_files,
    check_calibration_source,
    head_row_weights,
)

logger = logging.getLogger(__name__)


DEFAULT_SWEEP_RANK_DIVISORS = (32, 16, 8, 4, 2)  # ranks d/32 ... d/2


DEFAULT_SWEEP_MAX_EXAMPLES = 32


DEFAULT_SWEEP_MAX_LENGTH = 256


DEFAULT_SWEEP_BATCH_SIZE = 4


DEFAULT_NUM_DRAFT_TOKENS = 5  # k of the chain model used to turn acceptance into tau (= DraftConfig.depth)


# sampling: sum_v min(p_v, q_v) (speculative sampling); greedy: top-1 agreement (greedy decoding)
ACCEPTANCE_KINDS = ("sampling", "greedy")


@dataclass(frozen=True)
class RankSweepConfig:
    """Options of ``slimspec rank-sweep``.

    ``ranks`` entries are ints or ``"d/N"`` strings. ``kappa`` None means measure it on this machine.
    """

    ranks: tuple[int | str, ...] = tuple(f"d/{n}" for n in DEFAULT_SWEEP_RANK_DIVISORS)
    kappa: float | None = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    max_examples: int = DEFAULT_SWEEP_MAX_EXAMPLES
    max_length: int = DEFAULT_SWEEP_MAX_LENGTH
    batch_size: int = DEFAULT_SWEEP_BATCH_SIZE
    dtype: str = AUTO_DTYPE  # bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"
    warmup: int = DEFAULT_BENCH_WARMUP
    repeats: int = DEFAULT_BENCH_REPEATS
    finetune_steps: int = 0  # 0: SVD only; N: a short head fine-tune per rank (finetune.train.trainer)
    finetune_data: tuple[str, ...] = ()
    rerank: int = 0  # k > 0: every low-rank head rescores its top k exactly (LowRankHead.set_rerank)
    calibration_data: tuple[str, ...] = ()  # () = plain SVD; files: calibrated factors, as convert's
    calibration_source: str = "target"  # as slimspec convert: target answers, or human (files' own)
    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES
    acceptance: str = "sampling"  # the alpha the chain model turns into tau: sampling or greedy (top-1)
    force: bool = False

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("RankSweepConfig.ranks is empty")
        check_calibration_source("RankSweepConfig.calibration_source", self.calibration_source)
        if self.rerank < 0:
            raise ValueError(f"RankSweepConfig.rerank={self.rerank}: expected >= 0 (0 = no rerank)")
        if self.acceptance not in ACCEPTANCE_KINDS:
            raise ValueError(
                f"RankSweepConfig.acceptance={self.acceptance!r}: "
                f"expected one of {', '.join(ACCEPTANCE_KINDS)}"
            )
        if self.finetune_steps < 0:
            raise ValueError(f"RankSweepConfig.finetune_steps={self.finetune_steps}: expected >= 0")
        if self.finetune_steps and not self.finetune_data:
            raise ValueError(
                "RankSweepConfig.finetune_steps needs finetune_data (--finetune-data, not the held-out data)"
            )
        if self.kappa is not None and self.kappa < 0:
            raise ValueError(f"RankSweepConfig.kappa={self.kappa}: expected >= 0")
        for name in ("num_draft_tokens", "max_examples", "batch_size", "repeats", "calibration_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"RankSweepConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.max_length < 3:
            raise ValueError(f"RankSweepConfig.max_length={self.max_length}: expected >= 3")
        if self.warmup < 0:
            raise ValueError(f"RankSweepConfig.warmup={self.warmup}: expected >= 0")
        check_run_dtype("RankSweepConfig", self.dtype)
        check_device_name("RankSweepConfig", self.device)


SWEEP_JSON, SWEEP_MD = "rank_sweep.json", "rank_sweep.md"


ACCEPTANCE_PNG, LATENCY_PNG = "rank_vs_acceptance.png", "rank_vs_latency.png"


@dataclass(frozen=True)
class SweepRow:
    """One rank of the sweep (rank None = the full head)."""

    rank: int | None
    relative_error: float
    energy_retained: float
    expected_acceptance: float
    top1_agreement: float
    tau_estimate: float
    head_ms: float
    nu: float
    rho_tau: float
    predicted_speedup: float
    break_even_rho_tau: float
    expected_acceptance_svd: float  # before any fine-tune (equals expected_acceptance without one)


@dataclass(frozen=True)
class SweepResult:
    """Everything ``rank-sweep`` reports; ``recommended_rank`` None means keep the full head."""

    hidden_size: int
    draft_vocab_size: int
    kappa: float
    kappa_source: str
    kappa_measurement: KappaMeasurement | None
    num_draft_tokens: int
    num_positions: int
    rows: tuple[SweepRow, ...]
    recommended_rank: int | None
    recommended_speedup: float
    ceiling: float
    finetune_steps: int = 0
    rerank: int = 0
    acceptance: str = "sampling"
    calibrated: bool = False

    def to_dict(self) -> dict:
        """JSON-ready dict (with the package version)."""
        return {**asdict(self), "version": __version__}


def sweep_ranks(
    drafter: Eagle3Drafter,
    target_model,
    batches: Sequence[Mapping[str, Tensor]],
    ranks: Sequence[int],
    cfg: RankSweepConfig,
    kappa: float | None = None,
    kappa_measurement: KappaMeasurement | None = None,
    tune: Callable[[dict[str, LowRankHead]], dict[str, nn.Module]] | None = None,
    calibration: HeadCalibration | None = None,
) -> SweepResult:
    """Evaluate every rank against the drafter's full head and recommend one.

    Args:
        drafter: drafter with a dense head ``W [V_d, d]`` (trimmed vocabularies are fine).
        target_model: HF causal LM.
        batches: held-out batches (see :func:`expected_acceptance_by_head`).
        ranks: absolute ranks.
        cfg: repeat policy and k (``num_draft_tokens``).
        kappa: the kappa to use (given with ``--kappa``), or None to take ``kappa_measurement.kappa``.
        kappa_measurement: stage timings when kappa was measured.
        tune: optional map from the SVD heads (keyed by ``str(r)``) to fine-tuned heads of the same
            shapes (e.g. :func:`finetune_heads`); the cost model then uses the tuned acceptance and
            ``expected_acceptance_svd`` keeps the SVD-only value.
        calibration: the head input's second moment (``workflows.calibrate``): each rank's factors
            are then ``slimspec convert``'s calibrated ones (``lowrank.calibrated``, rows weighted by
            next-token frequency) instead of the plain truncated SVD, and ``relative_error`` is their
            weight-space error (``energy_retained`` = 1 - error^2).

    Returns:
        :class:`SweepResult` (rows: the full head first, then ranks ascending).

    With ``cfg.rerank`` = k > 0 every low-rank head is measured with the shortlist rerank on (its
    top k rescored exactly with the dense rows, no context pool): acceptance and latency are those
    of ``--rerank k`` decoding. ``cfg.acceptance`` picks the alpha of the chain model: ``sampling``
    (expected acceptance) or ``greedy`` (top-1 agreement).

    Raises:
        ValueError: the head is already low-rank, neither kappa nor a measurement is given, or a
            rerank for a drafter whose dense head is not its embedding table (the rows it rescores
            with) or k > V_d.
    """
    if isinstance(drafter.lm_head, LowRankHead):
        raise ValueError("the drafter's head is already low-rank; rank-sweep needs the original dense head")
    if kappa is None and kappa_measurement is None:
        raise ValueError("give kappa (--kappa) or a kappa measurement")
    kappa_value = kappa if kappa is not None else kappa_measurement.kappa
    W = drafter.lm_head.weight.detach()  # [V_d, d], on the drafter's device
    V_d, d = W.shape
    ranks = sorted(set(ranks))
    W_host = W.cpu()  # the factorisation is host math (lowrank/), done once per sweep
    energy = torch.cumsum(spectrum(W_host) ** 2, 0)
    energy = energy / energy[-1]  # [min(V_d, d)] float64, retained energy at rank i + 1
    heads: dict[str, nn.Module] = {"full": drafter.lm_head}
    weight_error: dict[int, float] = {}
    if calibration is None:
        fac = lowrank_factorize(W_host.float(), ranks[-1])
    else:
        d2t = drafter.d2t.cpu() if drafter.config.is_trimmed else None
        row_weights = head_row_weights(calibration, V_d, d2t, DEFAULT_TOKEN_WEIGHT)
    for r in ranks:
        head = LowRankHead(d, V_d, r, dtype=W.dtype)
        if calibration is not None:
            fac = calibrated_factorize(W_host.float(), r, calibration.second_moment, row_weights=row_weights)
            weight_error[r] = fac.relative_error
        with torch.no_grad():  # the leading r directions of the rank-max SVD are the rank-r one
            head.up.weight.copy_(fac.W_up[:, :r])
            head.down.weight.copy_(fac.W_down[:r])
        heads[str(r)] = head.to(W.device).eval()
    tuned = tune({str(r): heads[str(r)] for r in ranks}) if tune is not None else {}
    if cfg.rerank:
        _rerank_heads(drafter, [heads[str(r)] for r in ranks] + list(tuned.values()), cfg.rerank)
    acc = expected_acceptance_by_head(
        drafter, target_model, batches, {**heads, **{f"{n}+ft": h for n, h in tuned.items()}}
    )
    svd_acc = {n: acc[n].expected_acceptance for n in heads}
    acc.update({n: acc.pop(f"{n}+ft") for n in tuned})  # the tuned head's acceptance is the one used
    x = torch.randn(1, d, dtype=W.dtype, generator=torch.Generator().manual_seed(0)).to(W.device)  # [1, d]
    head_ms = time_module_calls(  # same shapes when tuned
        heads, x, warmup=cfg.warmup, repeats=cfg.repeats, device=W.device
    )
    k = cfg.num_draft_tokens
    alpha = {
        n: a.top1_agreement if cfg.acceptance == "greedy" else a.expected_acceptance for n, a in acc.items()
    }
    tau = {n: expected_tau(min(1.0, a), k) for n, a in alpha.items()}
    rec = recommend_rank(
        RankCandidate(None, tau["full"], head_ms["full"]),
        [RankCandidate(r, tau[str(r)], head_ms[str(r)]) for r in ranks],
        kappa_value,
    )
    rows = []
    for pred in rec.predictions:
        name = "full" if pred.rank is None else str(pred.rank)
        if pred.rank is None:
            e = 1.0
        elif pred.rank in weight_error:
            e = 1.0 - weight_error[pred.rank] ** 2
        else:
            e = float(energy[pred.rank - 1])
        rows.append(
            SweepRow(
                pred.rank,
                max(0.0, 1.0 - e) ** 0.5,
                e,
                acc[name].expected_acceptance,
                acc[name].top1_agreement,
                tau[name],
                head_ms[name],
                pred.nu,
                pred.rho_tau,
                pred.predicted_speedup,
                pred.break_even_rho_tau,
                svd_acc[name],
            )
        )
    return SweepResult(
        d,
        V_d,
        kappa_value,
        "given" if kappa is not None else "measured",
        kappa_measurement,
        k,
        acc["full"].num_positions,
        tuple(rows),
        rec.best.rank,
        rec.best.predicted_speedup,
        rec.ceiling,
        cfg.finetune_steps if tune is not None else 0,
        cfg.rerank,
        cfg.acceptance,
        calibration is not None,
    )


def _rerank_heads(drafter: Eagle3Drafter, heads: Sequence[nn.Module], k: int) -> None:
    """Turn the shortlist rerank on for ``heads`` with the drafter's embedding rows.

    Raises:
        ValueError: the drafter's dense head differs from its embedding table, or k > V_d.
    """
    emb = drafter.embed_tokens.weight
    if drafter.lm_head.weight.shape != emb.shape or not torch.equal(drafter.lm_head.weight, emb):
        raise ValueError(
            f"--rerank {k}: the drafter's dense lm_head {list(drafter.lm_head.weight.shape)} is not its "
            f"embedding table {list(emb.shape)}; the rerank rescores with embedding rows, so it serves only "
            "heads that are the (tied) embedding (train-drafter --train body, speculators heads of tied "
            "targets)"
        )
    for head in heads:
        head.set_rerank(k, drafter.embed_tokens)


def finetune_heads(
    drafter: Eagle3Drafter,
    target_model,
    heads: Mapping[str, LowRankHead],
    train_examples: list,
    eval_examples: list,
    steps: int,
    out_dir: Path,
    pad_id: int,
) -> dict[str, nn.Module]:
    """Short KL fine-tune of each SVD head on the drafter body (``finetune.train.trainer.Trainer``,
    train='head').

    Each run writes its folder ``out_dir / finetune_r{r}`` (the trainer's best-by-held-out drafter,
    state and logs); the returned head is the one after the last step, so the sweep's acceptance is
    not selected on the data it is measured on.

    Args:
        drafter: the full-head drafter (its body is copied, frozen).
        target_model: HF causal LM (the teacher).
        heads: ``str(r)`` -> SVD-initialised :class:`LowRankHead`.
        train_examples: ``slimspec_convert.data.examples.Example`` list (never the held-out data).
        eval_examples: held-out examples for the trainer's own evaluation.
        steps: optimizer steps per rank.
        out_dir: parent folder of the per-rank runs.
        pad_id: padding token id.

    Returns:
        ``str(r)`` -> fine-tuned head (float32).
    """

    cfg = FinetuneConfig(
        steps=steps,
        train="head",
        eval_every=steps,
        save_every=steps,
        eval_batches=1,
        warmup_steps=min(10, steps // 10),
    )
    aux = resolve_aux_layers(drafter.config, target_model)
    out = {}
    for name, head in heads.items():
        low = with_head(drafter, head).float()
        Trainer(
            low, target_model, aux, train_examples, eval_examples, cfg, out_dir / f"finetune_r{name}", pad_id
        ).run()
        out[name] = low.lm_head.requires_grad_(False).eval()
    return out


def write_sweep(result: SweepResult, out_dir: Path, force: bool = False) -> list[Path]:
    """Write JSON, markdown and the two PNG plots into ``out_dir``.

    Raises:
        FileExistsError: an output exists and force is off.
    """
    paths = [out_dir / n for n in (SWEEP_JSON, SWEEP_MD, ACCEPTANCE_PNG, LATENCY_PNG)]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing} exist; pass --force to overwrite")
    atomic_write_json(paths[0], result.to_dict())
    atomic_write_bytes(paths[1], sweep_markdown(result).encode())
    low = [r for r in result.rows if r.rank is not None]
    full = result.rows[0]
    plot_rank_vs_acceptance(
        [r.rank for r in low],
        [r.expected_acceptance for r in low],
        [r.top1_agreement for r in low],
        full.expected_acceptance,
        full.top1_agreement,
        paths[2],
    )
    plot_rank_vs_latency(
        [r.rank for r in low],
        [r.head_ms for r in low],
        full.head_ms,
        paths[3],
        label=f"(d={result.hidden_size}, V_d={result.draft_vocab_size}, batch 1)",
    )
    return paths


def load_eval_batches(
    paths: Sequence[str | Path], tokenizer, cfg: RankSweepConfig
) -> tuple[list, list[dict]]:
    """Held-out examples and their batches (assistant tokens supervised; prompt-only records skipped).

    Returns:
        (``slimspec_convert.data.examples.Example`` list, right-padded batches of ``cfg.batch_size``
        from ``collate``).

    Raises:
        FileNotFoundError: a missing file.
        ValueError: malformed data or no conversation with an assistant turn.
    """

    examples = build_examples(tokenizer, read_conversations(list(paths)), cfg.max_length)[: cfg.max_examples]
    if not examples:
        raise ValueError(
            f"{[str(p) for p in paths]}: no conversation with an assistant turn for held-out acceptance"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = [
        collate(examples[i : i + cfg.batch_size], pad) for i in range(0, len(examples), cfg.batch_size)
    ]
    return examples, batches


def rank_sweep(
    target: str | Path,
    drafter_path: str | Path,
    data: Sequence[str | Path],
    out: str | Path,
    cfg: RankSweepConfig,
) -> SweepResult:
    """``slimspec rank-sweep``: load, sweep, write JSON + markdown + plots into ``out``.

    Raises:
        FileExistsError: outputs exist and ``cfg.force`` is off.
        FileNotFoundError: missing target, drafter or data.
        ValueError: bad ranks, data or checkpoint.
    """
    out = Path(out)
    if not cfg.force and any((out / n).exists() for n in (SWEEP_JSON, SWEEP_MD, ACCEPTANCE_PNG, LATENCY_PNG)):
        raise FileExistsError(f"{out}: holds rank-sweep results; pass --force to overwrite")
    if not Path(drafter_path).is_dir():
        raise FileNotFoundError(f"{drafter_path}: drafter folder not found")
    model, tokenizer = load_target(target, cfg.dtype, cfg.device)
    drafter = load_drafter_with_target_embeddings(drafter_path, model)
    drafter = drafter.to(device=model.device, dtype=model.dtype).eval()
    ranks = resolve_ranks(cfg.ranks, drafter.config.hidden_size)
    examples, batches = load_eval_batches(data, tokenizer, cfg)
    tune = None
    if cfg.finetune_steps:
        train, _ = load_examples(tokenizer, list(cfg.finetune_data), cfg.max_length)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        def tune(heads):
            return finetune_heads(drafter, model, heads, train, examples, cfg.finetune_steps, out, pad)

    measurement = None
    if cfg.kappa is None:
        first = batches[0]["input_ids"][:1, : int(batches[0]["attention_mask"][0].sum())]
        measurement = measure_kappa(
            drafter, model, first, cfg.num_draft_tokens, warmup=cfg.warmup, repeats=cfg.repeats
        )
    calibration = None
    if cfg.calibration_data:
        calibration = calibrate_from_files(
            drafter_path,
            target,
            list(cfg.calibration_data),
            samples=cfg.calibration_samples,
            device=cfg.device,
            dtype=cfg.dtype,
            source=cfg.calibration_source,
        )
    result = sweep_ranks(drafter, model, batches, ranks, cfg, cfg.kappa, measurement, tune, calibration)
    write_sweep(result, out, force=cfg.force)
    logger.info(
        "rank sweep written to %s: %s", out, json.dumps({"recommended_rank": result.recommended_rank})
    )
    return result


_ALPHA_WORDS = {"sampling": "expected acceptance", "greedy": "top-1 agreement"}


def sweep_markdown(result: SweepResult) -> str:
    """A markdown table of the sweep plus the recommendation line."""
    lines = [
        f"Rank sweep: d={result.hidden_size}, V_d={result.draft_vocab_size}, kappa={result.kappa:.3f} "
        f"({result.kappa_source}), k={result.num_draft_tokens}, {result.num_positions} held-out positions. "
        f"tau = accepted drafts + 1 bonus (chain model from {_ALPHA_WORDS[result.acceptance]}).",
        "",
        "| rank | SVD rel. error | energy | exp. acceptance (SVD only) | top-1 | tau est. | head ms | nu "
        "| rho_tau | predicted rho_TPS | break-even rho_tau |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if result.calibrated:
        lines[0] += " Calibrated factors (as slimspec convert's; error and energy in weight space)."
    if result.rerank:
        lines[0] += f" Every low-rank head with the shortlist rerank of its top {result.rerank}."
    if result.finetune_steps:
        lines[0] += f" Low-rank acceptance after a {result.finetune_steps}-step head fine-tune."
    for r in result.rows:
        lines.append(
            f"| {'full' if r.rank is None else r.rank} | {r.relative_error:.4f} | {r.energy_retained:.4f} "
            f"| {r.expected_acceptance:.4f} ({r.expected_acceptance_svd:.4f}) | {r.top1_agreement:.4f} "
            f"| {r.tau_estimate:.3f} "
            f"| {r.head_ms:.3f} | {r.nu:.3f} | {r.rho_tau:.4f} | {r.predicted_speedup:.4f} "
            f"| {r.break_even_rho_tau:.4f} |"
        )
    best = "the full head" if result.recommended_rank is None else f"rank {result.recommended_rank}"
    lines += [
        "",
        f"Recommended: {best} (predicted rho_TPS {result.recommended_speedup:.4f}; "
        f"ceiling 1 + kappa = {result.ceiling:.4f}).",
    ]
    return "\n".join(lines) + "\n"
