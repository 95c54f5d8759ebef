"""End-to-end benchmark: plain decoding and several drafters on the same prompts, interleaved, greedy.

For each batch of prompts every configuration runs once, in an order rotated per batch, so machine
drift hits all of them alike. Reported per configuration: tau (accepted drafts + 1 bonus per
verification), tokens/s, speedup over plain decoding, per-round stage milliseconds, and the lossless
check (greedy outputs identical to plain decoding). Against the full-head reference drafter the
cost model's inputs are measured in the same run:

* ``kappa = head_ms / (wall_ms - head_ms)`` of the reference (whole run, prefill included, so that it
  matches the measured tokens/s ratio it predicts);
* ``nu = (head_ms / rounds)_new / (head_ms / rounds)_ref``: both drafters use the same draft shape, so
  head calls per round are equal and this is the per-call ratio;
* ``rho_tau = tau_new / tau_ref``; predicted ``rho_TPS`` (SlimSpec section 3) beside the measured
  tokens/s ratio.

:func:`measure_kappa` estimates kappa without decoding, from interleaved timings of the stages of one
chain step (used by ``rank-sweep``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from . import __version__
from .bench import time_interleaved
from .checkpoint import atomic_write_bytes, atomic_write_json
from .config import E2E_PLAIN_NAME, BenchE2EConfig, DraftConfig, SamplingConfig
from .costmodel import kappa_from_times, predicted_speedup
from .drafter import DraftKVCache, Eagle3Drafter
from .generate import GenerationResult, SpeculativeGenerator
from .head import LowRankHead
from .plots import plot_predicted_vs_measured
from .target import check_aux_layers, num_target_layers, target_forward

logger = logging.getLogger(__name__)

E2E_JSON, E2E_MD, E2E_PNG = "e2e.json", "e2e.md", "e2e_speedup.png"


def head_kind(drafter: Eagle3Drafter | None) -> str:
    """``plain`` (no drafter), ``full``, ``lowrank``, ``trimmed`` or ``lowrank+trimmed``."""
    if drafter is None:
        return "plain"
    low = isinstance(drafter.lm_head, LowRankHead)
    trimmed = drafter.d2t is not None
    return {(False, False): "full", (True, False): "lowrank", (False, True): "trimmed"}.get(
        (low, trimmed), "lowrank+trimmed"
    )


@dataclass(frozen=True)
class KappaMeasurement:
    """Stage times of one chain speculation step (k draft steps, one verification of k + 1 tokens).

    Attributes:
        num_draft_tokens: k.
        head_ms: one full-head call, batch 1.
        body_ms: one drafter body step (decoder layer over a cached prefix).
        fuse_ms: fusing k + 1 verified positions' aux states.
        verify_ms: target forward of k + 1 tokens over a cached prefix.
        kappa: ``k head_ms / (k body_ms + fuse_ms + verify_ms)``.
    """

    num_draft_tokens: int
    head_ms: float
    body_ms: float
    fuse_ms: float
    verify_ms: float
    kappa: float


@torch.no_grad()
def measure_kappa(
    drafter: Eagle3Drafter,
    target_model,
    input_ids: Tensor,
    num_draft_tokens: int,
    *,
    warmup: int = 1,
    repeats: int = 15,
) -> KappaMeasurement:
    """Estimate kappa on this machine from interleaved stage timings of a chain step after a real prefix.

    Args:
        drafter: drafter with the *full* head.
        target_model: HF causal LM.
        input_ids: [1, L] prefix (L >= 2).
        num_draft_tokens: k.
        warmup: untimed rounds.
        repeats: timed rounds.

    Returns:
        :class:`KappaMeasurement`.
    """
    aux_layers = drafter.config.resolved_aux_layer_ids(num_target_layers(target_model))
    check_aux_layers(aux_layers, num_target_layers(target_model))
    dtype = next(p.dtype for p in drafter.parameters() if p.is_floating_point())
    L, k = input_ids.shape[1], num_draft_tokens
    prefill = target_forward(target_model, input_ids, aux_layers, use_cache=True)
    cache = prefill.past_key_values
    feats = drafter.fuse(prefill.aux_hidden[:, :-1].to(dtype))  # [1, L-1, d]
    dcache = DraftKVCache()
    drafter(input_ids[:, 1:], feats, torch.arange(L - 1)[None], cache=dcache)
    new_ids = input_ids[:, -1:].expand(1, k + 1).contiguous()  # [1, k+1], values do not change the cost
    step_in = (input_ids[:, -1:], feats[:, -1:], torch.tensor([[L - 1]]))
    normed = drafter.norm(feats[:, -1:])  # [1, 1, d]
    aux_verify = prefill.aux_hidden[:, -(k + 1) :].to(dtype)  # [1, k+1, K*dt] (clamped by L)

    def verify():
        target_forward(target_model, new_ids, aux_layers, past_key_values=cache, use_cache=True)
        cache.crop(-(k + 1))  # drop the k + 1 verified tokens again

    def body():
        drafter(*step_in, cache=dcache)
        dcache.crop(L - 1)

    fns = {
        "head": lambda: drafter.lm_head(normed),
        "body": body,
        "fuse": lambda: drafter.fuse(aux_verify),
        "verify": verify,
    }
    t = {
        n: v.median_ms
        for n, v in time_interleaved(fns, warmup=warmup, repeats=repeats, min_repeats=min(3, repeats)).items()
    }
    kappa = kappa_from_times(k * t["head"], k * t["body"] + t["fuse"] + t["verify"])
    return KappaMeasurement(k, t["head"], t["body"], t["fuse"], t["verify"], kappa)


@dataclass(frozen=True)
class E2ERow:
    """One configuration's totals over all prompts (ms are wall-clock; per-round = per verification).

    ``nu``, ``rho_tau``, ``predicted_rho_tps`` and ``measured_rho_tps`` are relative to the reference
    drafter (None for plain decoding or when there is no full-head reference).
    """

    name: str
    kind: str
    rank: int | None
    draft_vocab_size: int | None
    tau: float | None
    new_tokens: int
    rounds: int
    wall_ms: float
    tokens_per_s: float
    speedup: float
    target_ms_per_round: float | None
    backbone_ms_per_round: float | None
    head_ms_per_round: float | None
    overhead_ms_per_round: float | None
    head_ms: float
    lossless: bool | None
    num_mismatched_prompts: int
    nu: float | None = None
    rho_tau: float | None = None
    predicted_rho_tps: float | None = None
    measured_rho_tps: float | None = None
    rerank_k: int = 0  # shortlist rerank of a low-rank head (LowRankHead.set_rerank), 0 = off


@dataclass(frozen=True)
class E2EResult:
    """Everything ``bench e2e`` reports."""

    rows: tuple[E2ERow, ...]
    reference: str | None
    kappa: float | None
    num_prompts: int
    config: dict
    per_prompt: dict[str, list[dict]]

    def to_dict(self) -> dict:
        """JSON-ready dict with the package version."""
        return {**asdict(self), "version": __version__}


@dataclass
class _Totals:
    wall_ms: float = 0.0
    new_tokens: int = 0
    committed: int = 0
    cycles: int = 0
    rounds: int = 0
    target_ms: float = 0.0
    backbone_ms: float = 0.0
    head_ms: float = 0.0
    overhead_ms: float = 0.0

    def add(self, results: list[GenerationResult], wall_ms: float) -> None:
        self.wall_ms += wall_ms
        last = max(results, key=lambda r: r.stats.wall_ms)  # batch-level times up to the last row's end
        self.target_ms += last.stats.target_ms
        self.backbone_ms += last.stats.drafter_backbone_ms
        self.head_ms += last.stats.drafter_head_ms
        self.overhead_ms += last.stats.overhead_ms
        self.rounds += max(r.stats.cycles for r in results)
        for r in results:
            self.new_tokens += r.stats.new_tokens
            self.committed += sum(r.stats.committed_per_cycle)
            self.cycles += r.stats.cycles


def run_e2e(
    target_model,
    tokenizer,
    drafters: Mapping[str, Eagle3Drafter],
    prompts: Sequence[str],
    cfg: BenchE2EConfig,
    progress: Callable[[str], None] | None = None,
) -> E2EResult:
    """Decode ``prompts`` with plain decoding and every drafter, interleaved per batch; compare.

    Args:
        target_model: HF causal LM (eval mode).
        tokenizer: its tokenizer (chat template applied to the prompts).
        drafters: name -> drafter, in report order.
        prompts: user prompts.
        cfg: decoding length, batch size, draft method, reference.
        progress: called with a short line per batch.

    Returns:
        :class:`E2EResult` (plain decoding first).

    Raises:
        ValueError: a drafter that does not fit the target, or no prompts.
    """
    if not prompts:
        raise ValueError("no prompts to benchmark")
    draft = DraftConfig(method=cfg.draft_method)
    configs: dict[str, Eagle3Drafter | None] = {E2E_PLAIN_NAME: None, **drafters}

    def generator(drafter, max_new_tokens):
        sampling = SamplingConfig(max_new_tokens=max_new_tokens)
        return SpeculativeGenerator(
            target_model, tokenizer, drafter, draft, sampling, batch_size=cfg.batch_size
        )

    gens = {n: generator(d, cfg.max_new_tokens) for n, d in configs.items()}
    if cfg.warmup_tokens:
        for d in configs.values():
            generator(d, cfg.warmup_tokens).generate(list(prompts[: cfg.batch_size]))
    names = list(configs)
    totals = {n: _Totals() for n in names}
    outputs: dict[str, list[GenerationResult]] = {n: [] for n in names}
    for j, lo in enumerate(range(0, len(prompts), cfg.batch_size)):
        batch = list(prompts[lo : lo + cfg.batch_size])
        if progress is not None:
            progress(f"prompts {lo + 1}-{lo + len(batch)} of {len(prompts)}")
        for i in range(len(names)):
            name = names[(i + j) % len(names)]
            t0 = time.perf_counter()
            res = gens[name].generate(batch)
            totals[name].add(res, (time.perf_counter() - t0) * 1e3)
            outputs[name].extend(res)
    return _summarise(configs, totals, outputs, cfg)


def _reference(configs: Mapping[str, Eagle3Drafter | None], cfg: BenchE2EConfig) -> str | None:
    if cfg.reference is not None:
        return cfg.reference
    return next((n for n, d in configs.items() if head_kind(d) == "full"), None)


def _summarise(configs, totals: dict[str, _Totals], outputs, cfg: BenchE2EConfig) -> E2EResult:
    plain = outputs[E2E_PLAIN_NAME]
    tps = {n: t.new_tokens / (t.wall_ms / 1e3) for n, t in totals.items()}
    ref = _reference(configs, cfg)
    kappa = None
    if ref is not None:
        t = totals[ref]
        kappa = t.head_ms / (t.wall_ms - t.head_ms)
    rows = []
    for name, drafter in configs.items():
        t = totals[name]
        mism = sum(a.output_ids != b.output_ids for a, b in zip(outputs[name], plain, strict=True))
        low = drafter.lm_head if isinstance(getattr(drafter, "lm_head", None), LowRankHead) else None
        row = dict(
            name=name,
            kind=head_kind(drafter),
            rank=low.rank if low is not None else None,
            rerank_k=low.rerank_k if low is not None else 0,
            draft_vocab_size=drafter.config.draft_vocab_size if drafter is not None else None,
            tau=t.committed / t.cycles if t.cycles else None,
            new_tokens=t.new_tokens,
            rounds=t.rounds,
            wall_ms=t.wall_ms,
            tokens_per_s=tps[name],
            speedup=tps[name] / tps[E2E_PLAIN_NAME],
            target_ms_per_round=_per(t.target_ms, t.rounds),
            backbone_ms_per_round=_per(t.backbone_ms, t.rounds),
            head_ms_per_round=_per(t.head_ms, t.rounds),
            overhead_ms_per_round=_per(t.overhead_ms, t.rounds),
            head_ms=t.head_ms,
            lossless=None if drafter is None else mism == 0,
            num_mismatched_prompts=mism,
        )
        if ref is not None and drafter is not None and t.cycles and totals[ref].cycles:
            r = totals[ref]
            nu = (t.head_ms / t.rounds) / (r.head_ms / r.rounds)
            rho_tau = (t.committed / t.cycles) / (r.committed / r.cycles)
            row.update(
                nu=nu,
                rho_tau=rho_tau,
                predicted_rho_tps=predicted_speedup(rho_tau, nu, kappa),
                measured_rho_tps=tps[name] / tps[ref],
            )
        rows.append(E2ERow(**row))
    per_prompt = {
        n: [{"output_ids": o.output_ids, **asdict(o.stats)} for o in outs] for n, outs in outputs.items()
    }
    config = {**asdict(cfg), "draft": asdict(DraftConfig(method=cfg.draft_method))}
    return E2EResult(tuple(rows), ref, kappa, len(plain), config, per_prompt)


def _per(total: float, rounds: int) -> float | None:
    return total / rounds if rounds else None


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def e2e_markdown(result: E2EResult) -> str:
    """Markdown table of the run and the cost-model comparison."""
    cfg = result.config
    lines = [
        f"End-to-end, greedy, {result.num_prompts} prompts, {cfg['max_new_tokens']} new tokens max, batch "
        f"{cfg['batch_size']}, draft {cfg['draft']}. tau = accepted drafts + 1 bonus per verification.",
        "",
        "| drafter | head | tau | tokens/s | speedup vs plain | target ms/round | body ms/round "
        "| head ms/round | other ms/round | lossless | nu | rho_tau | predicted rho_TPS | measured rho_TPS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        head = (
            r.kind
            + (f" r={r.rank}" if r.rank else "")
            + (f" +rerank k={r.rerank_k}" if r.rerank_k else "")
            + (f" V_d={r.draft_vocab_size}" if r.draft_vocab_size else "")
        )
        lossless = (
            "-" if r.lossless is None else ("yes" if r.lossless else f"NO ({r.num_mismatched_prompts})")
        )
        lines.append(
            f"| {r.name} | {head} | {_f(r.tau)} | {r.tokens_per_s:.2f} | {r.speedup:.3f} "
            f"| {_f(r.target_ms_per_round, 2)} | {_f(r.backbone_ms_per_round, 2)} "
            f"| {_f(r.head_ms_per_round, 2)} | {_f(r.overhead_ms_per_round, 2)} | {lossless} "
            f"| {_f(r.nu)} | {_f(r.rho_tau)} | {_f(r.predicted_rho_tps)} | {_f(r.measured_rho_tps)} |"
        )
    if result.reference is None:
        lines += ["", "No full-head drafter in the run: kappa, nu and rho_tau are not defined."]
    else:
        lines += [
            "",
            f"Reference (full head): {result.reference}; kappa = {result.kappa:.4f} "
            f"(head ms / all other ms, whole run); ceiling 1 + kappa = {1 + result.kappa:.4f}.",
        ]
    return "\n".join(lines) + "\n"


def write_e2e(result: E2EResult, out_dir: Path, force: bool = False) -> list[Path]:
    """Write e2e.json, e2e.md and e2e_speedup.png (predicted vs measured rho_TPS) into ``out_dir``.

    Raises:
        FileExistsError: an output exists and force is off.
    """
    paths = [out_dir / n for n in (E2E_JSON, E2E_MD, E2E_PNG)]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing} exist; pass --force to overwrite")
    atomic_write_json(paths[0], result.to_dict())
    atomic_write_bytes(paths[1], e2e_markdown(result).encode())
    rows = [r for r in result.rows if r.predicted_rho_tps is not None]
    plot_predicted_vs_measured(
        [r.name for r in rows],
        [r.predicted_rho_tps for r in rows],
        [r.measured_rho_tps for r in rows],
        paths[2],
    )
    return paths


def bench_e2e(
    target: str | Path,
    prompts_path: str | Path,
    out: str | Path,
    cfg: BenchE2EConfig,
    progress: Callable[[str], None] | None = None,
) -> E2EResult:
    """``slimspec bench e2e``: load the target and drafters, run, write JSON + markdown + PNG.

    Raises:
        FileExistsError: outputs exist and ``cfg.force`` is off.
        FileNotFoundError: missing target, drafter or prompt file.
        ValueError: bad prompts, drafters that do not fit the target.
    """
    from .bench import resolve_dtype
    from .prompts import load_prompts
    from .target import load_target
    from .trim import load_drafter_with_target_embeddings

    out = Path(out)
    if not cfg.force and any((out / n).exists() for n in (E2E_JSON, E2E_MD, E2E_PNG)):
        raise FileExistsError(f"{out}: holds e2e results; pass --force to overwrite")
    prompts = [turns[0] for turns in load_prompts(prompts_path)][: cfg.max_prompts]
    dtype = resolve_dtype(cfg.dtype)
    model, tokenizer = load_target(target, dtype)
    drafters = {n: load_drafter_with_target_embeddings(p, model).to(dtype).eval() for n, p in cfg.drafters}
    for name, k in cfg.rerank:
        try:
            drafters[name].enable_rerank(k)
        except ValueError as e:
            raise ValueError(f"--rerank {name}={k}: {dict(cfg.drafters)[name]}: {e}") from e
    result = run_e2e(model, tokenizer, drafters, prompts, cfg, progress)
    write_e2e(result, out, force=cfg.force)
    return result
