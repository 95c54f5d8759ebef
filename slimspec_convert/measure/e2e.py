"""End-to-end benchmark: plain decoding and several drafters on the same prompts, interleaved, greedy.

For each batch of prompts every configuration runs once, in an order rotated per batch, so machine
drift hits all of them alike; with ``repeats > 1`` the whole round of configurations runs that many
times per batch (the order rotated again each time) and each configuration keeps its fastest run of
the batch, the rule of :mod:`timeit`: on a shared machine the slower runs measure the neighbours'
load, not the code (every repeat must decode the same tokens, or it counts as a mismatch).
Reported per configuration: tau (accepted drafts + 1 bonus per verification), tokens/s, speedup
over plain decoding, per-round stage milliseconds, and the lossless check (greedy outputs identical
to plain decoding). Against the full-head reference drafter the cost model's inputs are measured
in the same run:

* ``kappa = head_ms / (wall_ms - head_ms)`` of the reference (whole run, prefill included, so that it
  matches the measured tokens/s ratio it predicts);
* ``head_ms``: the drafter's lm_head (its product, a rerank's rescoring, and in greedy chains the
  pick over its rows, whose cost grows with the rows as the product's does);
* ``nu = (head_ms / rounds)_new / (head_ms / rounds)_ref``: both drafters use the same draft shape, so
  head calls per round are equal and this is the per-call ratio;
* ``rho_tau = tau_new / tau_ref``; predicted ``rho_TPS`` (SlimSpec section 3) beside the measured
  tokens/s ratio.

:func:`measure_kappa` estimates kappa without decoding, from interleaved timings of the stages of one
chain step (used by ``rank-sweep``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from slimspec_convert.decoding.config import AUTO_DRAFT, DraftConfig, SamplingConfig, check_draft_method
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.results import GenerationResult
from slimspec_convert.devices import AUTO_DTYPE, check_device_name, check_run_dtype
from slimspec_convert.lowrank.costmodel import predicted_speedup
from slimspec_convert.measure.chain_acceptance import OnPolicyEval, build_onpolicy_eval
from slimspec_convert.measure.draft_shape import (
    AUTO_LOOKUPS,
    DraftPlan,
    calibration_prompts,
    plan_draft_shape,
    shape_name,
)
from slimspec_convert.measure.kinds import by_kind
from slimspec_convert.measure.linear_product import apply_linear_product
from slimspec_convert.measure.machine import MachineState, read_competing_load, read_load_1m, run_machine
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.head import DEFAULT_RERANK_CONTEXT, LowRankHead
from slimspec_convert.targets.forward import resolve_aux_layers
from slimspec_convert.targets.linear_product import check_linear_product
from slimspec_convert.targets.load import resolve_chat
from slimspec_convert.version import __version__

DEFAULT_E2E_MAX_NEW_TOKENS = 64


DEFAULT_E2E_MAX_PROMPTS = 8


DEFAULT_E2E_WARMUP_TOKENS = 8


E2E_PLAIN_NAME = "none"  # the plain target-decoding baseline in bench e2e
E2E_LOOKUP_NAME = "lookup"  # with --lookup: the target with prompt lookup alone, no drafter


@dataclass(frozen=True)
class BenchE2EConfig:
    """Options of ``slimspec bench e2e``: drafters (name, path) timed against plain decoding, greedy.

    ``reference`` names the full-head drafter that defines kappa, nu and rho_tau (default: the first
    drafter whose head is dense and untrimmed). ``rerank`` holds (name, k) pairs: those low-rank
    drafters rescore their top-k logits with their embedding rows (``Eagle3Drafter.enable_rerank``),
    and the last ``rerank_context`` distinct tokens of each sequence.
    ``device`` and ``dtype`` place the target and every drafter (``auto``: cuda when available,
    bfloat16 there, float32 on the CPU). ``draft_method='auto'`` (the default, as in ``slimspec
    generate``) gives every drafter its own shape and prompt lookup
    (:mod:`~slimspec_convert.measure.draft_shape`), planned on the prompts of ``auto_prompts`` (None: the
    held-out training prompts, :func:`~slimspec_convert.measure.draft_shape.calibration_prompts`), so
    that no benchmark answer informs the choice. ``lookup`` sets the prompt lookup of every drafter by
    hand (0 = off; None: planned by ``auto``, off with tree or chain) and ``drafter_lookup`` holds
    (name, tokens) pairs that set it for one drafter (e.g. the same drafter twice, planned and by
    hand). When any drafter drafts with a lookup, the row ``lookup`` is added: the target with prompt
    lookup alone (the largest lookup of the drafters), so the table shows what a drafter adds beyond
    copying; ``lookup_row`` N adds it with N tokens whatever the drafters use. ``depth`` sets the
    draft steps of ``tree`` or ``chain`` (one fixed shape for every drafter: the cost model's premise).
    """

    drafters: tuple[tuple[str, str], ...]
    rerank: tuple[tuple[str, int], ...] = ()
    rerank_context: int = DEFAULT_RERANK_CONTEXT
    max_new_tokens: int = DEFAULT_E2E_MAX_NEW_TOKENS
    batch_size: int = 1
    draft_method: str = AUTO_DRAFT
    max_prompts: int = DEFAULT_E2E_MAX_PROMPTS
    dtype: str = AUTO_DTYPE
    device: str = "auto"
    reference: str | None = None
    warmup_tokens: int = DEFAULT_E2E_WARMUP_TOKENS
    force: bool = False
    auto_prompts: str | None = None  # --draft auto: calibration prompts file (None: held-out training ones)
    linear_product: str = "auto"  # slimspec_convert.targets.linear_product: auto, torch or transposed
    repeats: int = 1  # runs per batch and configuration, interleaved; the fastest is kept
    lookup: int | None = None  # prompt-lookup tokens grafted per round by hand, 0 = off, None = planned
    drafter_lookup: tuple[tuple[str, int], ...] = ()  # (name, tokens): one drafter's lookup by hand
    lookup_min_ngram: int = DraftConfig.lookup_min_ngram
    lookup_max_ngram: int = DraftConfig.lookup_max_ngram
    chat: bool | None = None  # chat template / completion prompts; None: the tokenizer decides
    depth: int | None = None  # draft steps per round with draft_method tree or chain (None: DraftConfig's)
    # the 'lookup' row with N tokens whatever the drafters use (None: only with a drafter's lookup)
    lookup_row: int | None = None

    def lookup_config(self, draft: DraftConfig | None = None, lookup: int = 0) -> DraftConfig:
        """``draft`` (default: ``DraftConfig()``) with this run's n-gram fields and ``lookup`` tokens."""
        return replace(
            draft or DraftConfig(),
            lookup=lookup,
            lookup_min_ngram=self.lookup_min_ngram,
            lookup_max_ngram=self.lookup_max_ngram,
        )

    def hand_lookup(self, name: str) -> int | None:
        """Drafter ``name``'s prompt lookup set by hand (``drafter_lookup``, then ``lookup``); None: planned
        (``draft_method`` auto) or off."""
        return dict(self.drafter_lookup).get(name, self.lookup)

    def __post_init__(self) -> None:
        check_linear_product("BenchE2EConfig", self.linear_product)
        if self.repeats < 1:
            raise ValueError(f"BenchE2EConfig.repeats={self.repeats}: must be >= 1")
        if not self.drafters:
            raise ValueError("BenchE2EConfig.drafters is empty: give at least one --drafter NAME=PATH")
        names = [n for n, _ in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"BenchE2EConfig.drafters: duplicate names in {names}")
        if E2E_PLAIN_NAME in names:
            raise ValueError(
                f"BenchE2EConfig.drafters: '{E2E_PLAIN_NAME}' is the plain-decoding baseline "
                "(always run); pick another name"
            )
        if E2E_LOOKUP_NAME in names:
            raise ValueError(
                f"BenchE2EConfig.drafters: '{E2E_LOOKUP_NAME}' is the prompt-lookup row; pick another name"
            )
        if self.lookup is not None and self.lookup < 0:
            raise ValueError(f"BenchE2EConfig.lookup={self.lookup}: expected >= 0 (0 = off), None = planned")
        for name, k in self.drafter_lookup:
            if name not in names:
                raise ValueError(
                    f"BenchE2EConfig.drafter_lookup: {name!r} is not one of the drafters {names}"
                )
            if not isinstance(k, int) or k < 0:
                raise ValueError(f"BenchE2EConfig.drafter_lookup: {name}={k!r}, expected an integer >= 0")
        self.lookup_config()  # validates the n-gram fields
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"BenchE2EConfig.depth={self.depth}: expected >= 1")
        if self.lookup_row is not None and self.lookup_row < 0:
            raise ValueError(f"BenchE2EConfig.lookup_row={self.lookup_row}: expected >= 0")
        if self.reference is not None and self.reference not in names:
            raise ValueError(f"BenchE2EConfig.reference={self.reference!r} is not one of {names}")
        for name, k in self.rerank:
            if name not in names:
                raise ValueError(f"BenchE2EConfig.rerank: {name!r} is not one of the drafters {names}")
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"BenchE2EConfig.rerank: {name}={k!r}, expected an integer k >= 1")
        if self.rerank_context < 0:
            raise ValueError(f"BenchE2EConfig.rerank_context={self.rerank_context}: expected >= 0")
        for name in ("max_new_tokens", "batch_size", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchE2EConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.warmup_tokens < 0:
            raise ValueError(f"BenchE2EConfig.warmup_tokens={self.warmup_tokens}: expected >= 0")
        check_draft_method("BenchE2EConfig", self.draft_method)
        check_run_dtype("BenchE2EConfig", self.dtype)
        check_device_name("BenchE2EConfig", self.device)


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
    rerank_context: int = 0  # with it, the distinct sequence tokens rescored too (0 = none)
    shape: str | None = None  # the draft shape (chain-3, tree-5x4/16), None for plain decoding
    predicted_tau: float | None = None  # --draft auto: the plan's predictions for its shape
    predicted_tokens_per_s: float | None = None
    lookup_tokens: int = 0  # accepted drafts only the prompt lookup proposed (GenerationStats.lookup_tokens)


@dataclass(frozen=True)
class E2EResult:
    """Everything ``bench e2e`` reports."""

    rows: tuple[E2ERow, ...]
    reference: str | None
    kappa: float | None
    num_prompts: int
    config: dict
    per_prompt: dict[str, list[dict]]
    machine: MachineState | None = None  # measure.machine.run_machine of the readings before and after
    linear_product: dict | None = None  # LinearProductChoice.to_dict() of the run
    provenance: dict | None = None  # measure.provenance.provenance(): date, command, versions, host
    by_kind: dict[str, list[dict]] | None = None  # kind of prompt -> per-configuration rows (by_kind())

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
    lookup_tokens: int = 0

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
            self.lookup_tokens += r.stats.lookup_tokens
            self.committed += sum(r.stats.committed_per_cycle)
            self.cycles += r.stats.cycles


def run_e2e(
    target_model,
    tokenizer,
    drafters: Mapping[str, Eagle3Drafter],
    prompts: Sequence[str],
    cfg: BenchE2EConfig,
    progress: Callable[[str], None] | None = None,
    kinds: Sequence[str | None] | None = None,
) -> E2EResult:
    """Decode ``prompts`` with plain decoding and every drafter, interleaved per batch; compare.

    Args:
        target_model: HF causal LM (eval mode).
        tokenizer: its tokenizer (prompts rendered as ``cfg.chat`` says,
            :func:`~slimspec_convert.targets.load.resolve_chat`).
        drafters: name -> drafter, in report order.
        prompts: user prompts.
        cfg: decoding length, batch size, draft method, reference, linear product (set on the
            target and every drafter first, :func:`.linear_product.apply_linear_product`), repeats
            (the fastest of that many interleaved runs per batch and configuration is kept).
        progress: called with a short line per batch.
        kinds: the kind of each prompt (writing, code, ...; the prompt file's ``kind`` field, None
            where it has none): the result then also reports each kind apart (:func:`by_kind`).

    Returns:
        :class:`E2EResult` (plain decoding first), with the machine's state (busy when other
        processes' CPU time before or after the run leaves the run's threads short of a core,
        :func:`~slimspec_convert.measure.machine.run_machine`), the linear product used and, with
        ``kinds``, the rows of each kind.

    Raises:
        ValueError: a drafter that does not fit the target, or no prompts.
    """
    if not prompts:
        raise ValueError("no prompts to benchmark")
    linear = apply_linear_product(target_model, drafters.values(), cfg.linear_product)
    if progress is not None:
        progress(linear.summary())
    plans = plan_shapes(target_model, tokenizer, drafters, cfg, progress)
    shapes: dict[str, DraftConfig] = {}
    fixed = {} if cfg.depth is None else {"depth": cfg.depth}
    for name in drafters:
        hand = cfg.hand_lookup(name) or 0
        shapes[name] = (
            plans[name].draft
            if name in plans
            else cfg.lookup_config(DraftConfig(method=cfg.draft_method, **fixed), hand)
        )
    configs: dict[str, Eagle3Drafter | None] = {E2E_PLAIN_NAME: None, **drafters}
    lookup_row = cfg.lookup_row or max((d.lookup for d in shapes.values()), default=0)
    if lookup_row:
        configs = {E2E_PLAIN_NAME: None, E2E_LOOKUP_NAME: None, **drafters}
        shapes[E2E_LOOKUP_NAME] = cfg.lookup_config(lookup=lookup_row)

    def generator(name, max_new_tokens):
        sampling = SamplingConfig(max_new_tokens=max_new_tokens)
        draft = shapes.get(name, DraftConfig())  # plain decoding ignores it
        return SpeculativeGenerator(
            target_model, tokenizer, configs[name], draft, sampling, chat=cfg.chat, batch_size=cfg.batch_size
        )

    load_before, others_before = read_load_1m(), read_competing_load()
    gens = {n: generator(n, cfg.max_new_tokens) for n in configs}
    if cfg.warmup_tokens:
        for n in configs:
            generator(n, cfg.warmup_tokens).generate(list(prompts[: cfg.batch_size]))
    names = list(configs)
    totals = {n: _Totals() for n in names}
    outputs: dict[str, list[GenerationResult]] = {n: [] for n in names}
    unstable: dict[str, set[int]] = {n: set() for n in names}  # prompts whose repeats differ
    for j, lo in enumerate(range(0, len(prompts), cfg.batch_size)):
        batch = list(prompts[lo : lo + cfg.batch_size])
        if progress is not None:
            progress(f"prompts {lo + 1}-{lo + len(batch)} of {len(prompts)}")
        best: dict[str, tuple[float, list[GenerationResult]]] = {}
        for rep in range(cfg.repeats):
            for i in range(len(names)):
                name = names[(i + j + rep) % len(names)]
                t0 = time.perf_counter()
                res = gens[name].generate(batch)
                ms = (time.perf_counter() - t0) * 1e3
                if name not in best:
                    best[name] = (ms, res)
                    continue
                for k, (a, b) in enumerate(zip(res, best[name][1], strict=True)):
                    if a.output_ids != b.output_ids:
                        unstable[name].add(lo + k)
                if ms < best[name][0]:
                    best[name] = (ms, res)
        for name, (ms, res) in best.items():
            totals[name].add(res, ms)
            outputs[name].extend(res)
    loads = [x for x in (load_before, read_load_1m()) if x is not None]
    p = next(target_model.parameters())
    run_on = {"device": str(p.device), "dtype": str(p.dtype).removeprefix("torch.")}  # what auto resolved to
    others = [x for x in (others_before, read_competing_load()) if x is not None]
    machine = run_machine(
        max(loads) if loads else None, max(others) if others else None, torch.get_num_threads()
    )
    result = _summarise(configs, totals, outputs, cfg, machine, run_on, shapes, plans, unstable)
    kinds_table = by_kind(result.per_prompt, kinds) if kinds is not None and any(kinds) else None
    return replace(result, linear_product=linear.to_dict(), by_kind=kinds_table)


def plan_shapes(
    target_model,
    tokenizer,
    drafters: Mapping[str, Eagle3Drafter],
    cfg: BenchE2EConfig,
    progress: Callable[[str], None] | None = None,
) -> dict[str, DraftPlan]:
    """``--draft auto``: each drafter's plan (shape and lookup), on the calibration prompts of
    ``cfg.auto_prompts`` (:func:`~slimspec_convert.measure.draft_shape.calibration_prompts`); the target
    answers them at most once per set of aux layers, and only where no cached plan exists.

    Returns:
        name -> :class:`DraftPlan`; empty unless ``cfg.draft_method`` is auto.
    """
    if cfg.draft_method != AUTO_DRAFT:
        return {}
    calibration = calibration_prompts(cfg.auto_prompts, chat=resolve_chat(tokenizer, cfg.chat).chat)
    answered: dict[tuple[int, ...], OnPolicyEval] = {}  # the target answers once per aux layers

    def answers(aux: tuple[int, ...]) -> OnPolicyEval:
        if aux not in answered:
            answered[aux] = build_onpolicy_eval(target_model, tokenizer, calibration, aux, chat=cfg.chat)
        return answered[aux]

    plans = {}
    for name, d in drafters.items():
        if progress is not None:
            progress(f"--draft auto: planning {name}")
        aux = resolve_aux_layers(d.config, target_model)
        hand = cfg.hand_lookup(name)
        plans[name] = plan_draft_shape(
            target_model,
            tokenizer,
            d,
            calibration,
            ev=lambda aux=aux: answers(aux),
            lookup=cfg.lookup_config(),
            lookups=AUTO_LOOKUPS if hand is None else (hand,),
            chat=cfg.chat,
        )
        if progress is not None:
            progress(f"{name}: {plans[name].summary()}")
    return plans


def _reference(configs: Mapping[str, Eagle3Drafter | None], cfg: BenchE2EConfig) -> str | None:
    if cfg.reference is not None:
        return cfg.reference
    return next((n for n, d in configs.items() if head_kind(d) == "full"), None)


def _summarise(
    configs,
    totals: dict[str, _Totals],
    outputs,
    cfg: BenchE2EConfig,
    machine: MachineState | None = None,
    run_on: dict[str, str] | None = None,
    shapes: dict[str, DraftConfig] | None = None,
    plans: dict[str, DraftPlan] | None = None,
    unstable: dict[str, set[int]] | None = None,
) -> E2EResult:
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
        differ = {
            k
            for k, (a, b) in enumerate(zip(outputs[name], plain, strict=True))
            if a.output_ids != b.output_ids
        }
        mism = len(differ | (unstable or {}).get(name, set()))
        low = drafter.lm_head if isinstance(getattr(drafter, "lm_head", None), LowRankHead) else None
        row = dict(
            name=name,
            kind="lookup" if name == E2E_LOOKUP_NAME else head_kind(drafter),
            rank=low.rank if low is not None else None,
            rerank_k=low.rerank_k if low is not None else 0,
            rerank_context=low.rerank_context if low is not None else 0,
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
            lossless=None if name == E2E_PLAIN_NAME else mism == 0,
            num_mismatched_prompts=mism,
            lookup_tokens=t.lookup_tokens,
        )
        if name == E2E_LOOKUP_NAME:
            row["shape"] = f"lookup-{shapes[name].lookup}"
        elif drafter is not None and shapes and name in shapes:
            row["shape"] = shape_name(shapes[name])
        if plans and name in plans:
            row.update(
                predicted_tau=plans[name].best.predicted_tau,
                predicted_tokens_per_s=plans[name].best.predicted_tokens_per_s,
            )
        same_shape = not shapes or shapes.get(name) == shapes.get(ref)  # the cost model's premise
        if ref is not None and drafter is not None and t.cycles and totals[ref].cycles and same_shape:
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
    config = {
        **asdict(cfg),
        "draft": {n: asdict(d) for n, d in (shapes or {}).items()},
        "auto_plans": {n: p.to_dict() for n, p in (plans or {}).items()},
        "run_on": run_on,
    }
    return E2EResult(tuple(rows), ref, kappa, len(plain), config, per_prompt, machine)


def _per(total: float, rounds: int) -> float | None:
    return total / rounds if rounds else None
