"""``--draft auto``: the chain or tree shape with the highest predicted tokens/s on this machine.

A speculation round costs ``T_draft(shape) + T_verify(n)``, with ``n`` the tokens the target verifies
(the root plus ``k`` drafts for a chain of depth ``k``, plus ``total_tokens`` for a tree), and commits
``tau(shape)`` tokens, so

    predicted tokens/s = tau(shape) / (T_draft(shape) + T_verify(n) + T_other(shape)).

* ``T_verify(n)``: the target's forward of ``n`` new tokens after a context as long as the
  calibration prompts' typical one (prompt plus half an answer, rounded up to 64 tokens), measured
  once per (target, device, dtype, threads, torch, context, linear product) and cached as JSON under
  ``$SLIMSPEC_CACHE/verify_cost`` (:func:`verify_cost`). On CPUs it grows with the tokens (SmolLM2 on
  2 cores, float32, 128-token context: 54 ms for 1 or 2, 78 for 4, 125 for 16), which is why trees
  that pay on GPUs do not here.
* ``T_draft + T_other``: the drafter's time per round and the loop's own work, measured by decoding
  a calibration prompt for a few rounds with each candidate shape (:func:`plan_draft_shape`).
* ``tau(shape)``: the drafter's per-depth acceptance on the target's own greedy answers to the
  calibration prompts (the on-policy metric, :mod:`~slimspec_convert.measure.chain_acceptance`): for a
  chain of depth ``k``, ``1 + p_1 + ... + p_k`` with ``p_j`` the share of round starts whose first ``j``
  drafts equal the target's tokens; for a tree of depth ``D``, top-k ``K`` and ``N`` nodes, the same
  with "equal" read as "within the drafter's ``min(K, N // D)`` best tokens" at every depth (a tree
  keeps about ``N / D`` nodes per level; an approximation, printed beside the measured figure).
  The mean is over the round starts greedy decoding visits (:func:`visited_round_starts`: the first
  answer token, then ``1 + a`` tokens on), not over every answer position, which over-weights the
  easy stretches that real decoding crosses in few rounds (the committed drafter with chain-1 +
  lookup-3 on its 4 calibration prompts: 2.370 over every position, 1.867 over the visited ones,
  1.893 measured by ``slimspec generate``).

With prompt lookup (``DraftConfig.lookup``, :mod:`slimspec_convert.decoding.lookup`) every candidate
carries the lookup branch, and both terms are read per round start: the lookup proposal there
(:func:`~slimspec_convert.decoding.lookup.lookup_matches` on the same answers) accepts ``a_l`` tokens
and the drafter ``a_d`` (the depths above), so the round commits ``1 + max(a_d, a_l)`` tokens and
verifies ``n + proposed - min(a_d, a_l)`` (the correct leading tokens both propose are one node);
predicted tokens/s = mean committed / (mean ``T_verify`` + ``T_draft + T_other``), the latter timed
with the lookup on; the means are over the round starts the walk visits with ``max(a_d, a_l)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from slimspec_convert.atomic import atomic_write_json
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.lookup import lookup_matches
from slimspec_convert.devices import clock_ms
from slimspec_convert.measure.chain_acceptance import (
    OnPolicyEval,
    build_onpolicy_eval,
    chain_ranks,
    round_starts,
    visited_round_starts,
)
from slimspec_convert.measure.machine import read_load_1m, timing_machine
from slimspec_convert.targets.cache import keep_cache_slots, new_target_cache
from slimspec_convert.targets.forward import _cache_kwarg, resolve_aux_layers
from slimspec_convert.targets.linear_product import linear_product

logger = logging.getLogger(__name__)

AUTO_DRAFT = "auto"  # --draft auto
AUTO_CALIBRATION_PROMPTS = 4  # prompts the target answers once to measure the drafter's acceptance
VERIFY_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
VERIFY_CONTEXT = 256  # cached tokens before the verified ones, unless the plan gives its own
VERIFY_TIMING = "interleaved-fastest"  # how the curve is timed (cache key: others are timed anew)
CHAIN_DEPTHS = (1, 2, 3, 4, 5)
TREE_SHAPES = ((3, 2, 6), (3, 3, 9), (4, 2, 8), (4, 3, 12), (4, 4, 16), (5, 3, 15), (5, 4, 20), (6, 4, 24))


@dataclass(frozen=True)
class VerifyCost:
    """The target's verification time against the number of tokens verified in one forward.

    Attributes:
        tokens: verified token counts measured (ascending).
        ms: fastest milliseconds of one forward for each count, after ``context`` cached tokens.
        context: cached tokens before the verified ones.
        key: what the figures are of (target, device, dtype, threads, torch version).
    """

    tokens: tuple[int, ...]
    ms: tuple[float, ...]
    context: int
    key: dict = field(default_factory=dict)

    def at(self, n: int) -> float:
        """Milliseconds to verify ``n`` tokens (linear between, and beyond, the measured counts)."""
        ts, ms = self.tokens, self.ms
        if n <= ts[0]:
            return ms[0]
        for i in range(1, len(ts)):
            if n <= ts[i]:
                w = (n - ts[i - 1]) / (ts[i] - ts[i - 1])
                return ms[i - 1] + w * (ms[i] - ms[i - 1])
        slope = (ms[-1] - ms[-2]) / (ts[-1] - ts[-2])
        return ms[-1] + slope * (n - ts[-1])

    def to_dict(self) -> dict:
        return asdict(self)


def verify_key(model, context: int) -> dict:
    """What a verification timing is of: target config hash, device, dtype, threads, torch, context,
    the linear layers' product (:mod:`slimspec_convert.targets.linear_product`) and the timing method."""
    p = next(model.parameters())
    cfg = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else ""
    return {
        "target": hashlib.sha256(cfg.encode()).hexdigest()[:16],
        "device": str(p.device),
        "dtype": str(p.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "context": context,
        "linear_product": linear_product(model),
        "timing": VERIFY_TIMING,
    }


@torch.no_grad()
def measure_verify_cost(
    model, tokens: Sequence[int] = VERIFY_TOKENS, context: int = VERIFY_CONTEXT, repeats: int = 5
) -> VerifyCost:
    """Time the target's forward of ``n`` new tokens after ``context`` cached ones, for each ``n``.

    Args:
        model: HF causal LM (eval mode).
        tokens: counts to measure.
        context: cached tokens before them (the cache is cropped back after every call).
        repeats: timed calls per count (the fastest is kept, the rule of :mod:`timeit` and of
            ``bench e2e``: the curve is cached and reused, so a burst of load while it is timed must
            not stay in it; one untimed round first). The counts are timed in turn, ``repeats + 1``
            rounds over all of them.

    Returns:
        :class:`VerifyCost` in milliseconds.
    """
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(100, vocab - 1, (1, context + max(tokens)), generator=g).to(dev)
    cache = new_target_cache()
    kw = _cache_kwarg(model)
    model(input_ids=ids[:, :context], use_cache=True, **{kw: cache})
    samples: dict[int, list[float]] = {n: [] for n in tokens}
    for r in range(repeats + 1):  # counts interleaved, so a burst of machine noise hits them all alike
        for n in tokens:
            x = ids[:, context : context + n]
            pos = torch.arange(context, context + n, device=dev)[None]
            t0 = clock_ms(dev)
            model(input_ids=x, position_ids=pos, use_cache=True, **{kw: cache})
            dt = clock_ms(dev) - t0
            keep_cache_slots(cache, context, None, 0)
            if r:
                samples[n].append(dt)
    ms = [min(samples[n]) for n in tokens]
    return VerifyCost(tuple(tokens), tuple(ms), context, verify_key(model, context))


def timing_cache_path(cache_dir: str | Path | None, kind: str, key: dict) -> Path:
    """``cache_dir`` (default ``$SLIMSPEC_CACHE/<kind>``) / a 16-hex hash of ``key`` + ``.json``."""
    from slimspec_convert.targets.fetch import cache_dir as default_cache

    folder = Path(cache_dir) if cache_dir is not None else default_cache() / kind
    return folder / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json")


def read_timing_cache(path: Path, key: dict) -> dict | None:
    """The cached JSON at ``path`` when it exists, parses, holds ``key`` and was timed on a quiet machine.

    A timing taken while the machine was busy (its ``machine`` record: other work competed for the
    cores, :func:`~slimspec_convert.measure.machine.timing_machine`), or one without that record (written
    before loads were recorded), is not reused: the caller times again and overwrites it, so a
    choice made under load does not stick once the machine is quiet.

    Returns:
        The cached dict, or None (logged when the file is unreadable or was timed under load).
    """
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        logger.warning("%s: unreadable timing cache; timing again", path)
        return None
    if not (isinstance(raw, dict) and raw.get("key") == key):
        return None
    machine = raw.get("machine")
    if not isinstance(machine, dict) or machine.get("busy") is not False:
        why = machine.get("reason") if isinstance(machine, dict) else "no load recorded"
        logger.warning("%s: timed on a busy machine (%s); timing again", path, why)
        return None
    return raw


def verify_cost(
    model, cache_dir: str | Path | None = None, refresh: bool = False, context: int = VERIFY_CONTEXT
) -> VerifyCost:
    """:func:`measure_verify_cost`, cached per (target, device, dtype, threads, torch, context, linear
    product) as JSON.

    Args:
        model: HF causal LM.
        cache_dir: folder of the cache files (default ``$SLIMSPEC_CACHE/verify_cost``).
        refresh: measure again even when a file exists.
        context: cached tokens before the verified ones.
    """
    key = verify_key(model, context)
    path = timing_cache_path(cache_dir, "verify_cost", key)
    raw = None if refresh else read_timing_cache(path, key)
    if raw is not None:
        try:
            return VerifyCost(tuple(raw["tokens"]), tuple(raw["ms"]), int(raw["context"]), raw["key"])
        except (KeyError, TypeError, ValueError):
            logger.warning("%s: unreadable verification-cost cache; measuring again", path)
    load_before = read_load_1m()
    vc = measure_verify_cost(model, context=context)
    atomic_write_json(
        path, {**vc.to_dict(), "machine": timing_machine(load_before, torch.get_num_threads()).to_dict()}
    )
    return vc


def shape_name(d: DraftConfig) -> str:
    """``chain-3`` or ``tree-5x4/16`` (depth x top-k / total tokens), ``+lookup-3`` with prompt lookup."""
    base = f"chain-{d.depth}" if d.method == "chain" else f"tree-{d.depth}x{d.top_k}/{d.total_tokens}"
    return base + (f"+lookup-{d.lookup}" if d.lookup else "")


def verified_tokens(d: DraftConfig) -> int:
    """Tokens the target verifies per round: the root plus the drafts."""
    return 1 + (d.depth if d.method == "chain" else d.total_tokens)


def drafter_accepted(ranks: torch.Tensor, d: DraftConfig) -> torch.Tensor:
    """Per round start, the drafts of shape ``d`` accepted (module docstring), [N] float32.

    Args:
        ranks: [depth_max, N] int64, the rank of the target's token among the drafter's logits at
            each depth of each round start (0 = its top token), teacher-forced on the target's text.
        d: the shape (its depth must not exceed depth_max).
    """
    k = 1 if d.method == "chain" else max(1, min(d.top_k, d.total_tokens // d.depth))
    return (ranks[: d.depth] < k).int().cumprod(0).float().sum(0)  # the first j depths all in


def predicted_tau(ranks: torch.Tensor, d: DraftConfig, starts: torch.Tensor | None = None) -> float:
    """Predicted tau of a shape (no lookup) from the drafter's ranks (:func:`drafter_accepted`).

    Args:
        ranks: [depth_max, N] as :func:`drafter_accepted`.
        d: the shape.
        starts: [N, 2] the round starts of ``ranks``' columns (:func:`round_starts`): the mean is
            then taken over the rounds greedy decoding visits (:func:`visited_round_starts`); None
            averages every round start (optimistic where easy stretches are long).
    """
    accepted = drafter_accepted(ranks, d)
    if starts is not None:
        accepted = accepted[visited_round_starts(accepted, starts)]
    return 1.0 + float(accepted.mean())


def lookup_rounds(ev: OnPolicyEval, depth: int, d: DraftConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup at the round starts of ``chain_ranks(drafter, ev, depth)``.

    Returns:
        (proposed [N], accepted [N]) float32: tokens the lookup proposes there and how many of them
        lead the target's answer.
    """
    starts = round_starts(ev, depth)
    proposed, accepted = [], []
    for n in range(ev.input_ids.shape[0]):
        t = starts[starts[:, 0] == n, 1]
        if t.numel() == 0:
            continue
        seq = ev.input_ids[n].tolist()
        end = int(ev.answer_mask[n].nonzero().max()) + 1
        hits = lookup_matches(seq, (t + 1).tolist(), end, d.lookup, d.lookup_min_ngram, d.lookup_max_ngram)
        proposed += [p for p, _ in hits]
        accepted += [a for _, a in hits]
    return torch.tensor(proposed, dtype=torch.float32), torch.tensor(accepted, dtype=torch.float32)


@dataclass(frozen=True)
class ShapeCandidate:
    """One shape's figures: predicted tau, the measured costs per round, predicted tokens/s."""

    shape: str
    draft: dict
    predicted_tau: float
    verify_ms: float
    draft_and_loop_ms: float
    predicted_tokens_per_s: float


@dataclass(frozen=True)
class DraftPlan:
    """What ``--draft auto`` chose and why.

    Attributes:
        draft: the chosen :class:`DraftConfig`.
        candidates: every shape tried, best first.
        plain_tokens_per_s: the target alone, predicted the same way (one token verified per round).
        verify: the verification-cost curve used.
        calibration_prompts: how many prompts gave the acceptance and the costs.
        seconds: time the planning took.
    """

    draft: DraftConfig
    candidates: tuple[ShapeCandidate, ...]
    plain_tokens_per_s: float
    verify: VerifyCost
    calibration_prompts: int
    seconds: float

    @property
    def best(self) -> ShapeCandidate:
        return self.candidates[0]

    def summary(self) -> str:
        b = self.best
        return (
            f"--draft auto: {b.shape} (predicted tau {b.predicted_tau:.2f}, {b.predicted_tokens_per_s:.1f} "
            f"tokens/s; plain decoding {self.plain_tokens_per_s:.1f}); runner-up "
            + ", ".join(f"{c.shape} {c.predicted_tokens_per_s:.1f}" for c in self.candidates[1:4])
        )

    def to_dict(self) -> dict:
        return {
            "draft": asdict(self.draft),
            "shape": self.best.shape,
            "predicted_tau": self.best.predicted_tau,
            "predicted_tokens_per_s": self.best.predicted_tokens_per_s,
            "plain_tokens_per_s": self.plain_tokens_per_s,
            "candidates": [asdict(c) for c in self.candidates],
            "verify": self.verify.to_dict(),
            "calibration_prompts": self.calibration_prompts,
            "seconds": self.seconds,
        }


def candidate_shapes(top_k_max: int) -> list[DraftConfig]:
    """Chains of depth 1-5 and eight trees of depth 3-6, top-k 2-4, ``N = K D`` nodes (one level of
    ``K`` per depth: wider trees cost more to verify than a CPU gains from them)."""
    out = [DraftConfig(method="chain", depth=k) for k in CHAIN_DEPTHS]
    out += [
        DraftConfig(method="tree", depth=d, top_k=k, total_tokens=n)
        for d, k, n in TREE_SHAPES
        if k <= top_k_max and n <= k + (d - 1) * k * k
    ]
    return out


def _draft_and_loop_ms(
    model, tokenizer, drafter, prompt: str, d: DraftConfig, new_tokens: int, chat: bool | None = None
) -> float:
    """Milliseconds per round outside the target's forward: drafting plus the loop's own work."""
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    gen = SpeculativeGenerator(model, tokenizer, drafter, d, sampling, chat=chat)
    t0 = time.perf_counter()
    res = gen.generate([prompt])[0]
    wall = (time.perf_counter() - t0) * 1e3
    return (wall - res.stats.target_ms) / max(1, res.stats.cycles)


def plan_draft_shape(
    model,
    tokenizer,
    drafter,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    cost_tokens: int = 16,
    cache_dir: str | Path | None = None,
    ev: OnPolicyEval | None = None,
    lookup: DraftConfig | None = None,
    chat: bool | None = None,
) -> DraftPlan:
    """Pick the draft shape with the highest predicted greedy tokens/s (module docstring).

    Args:
        model: the target (eval mode), on its device and dtype.
        tokenizer: its tokenizer.
        drafter: the drafter, on the same device and dtype.
        prompts: calibration prompts (a few: each is answered by the target once, ``max_new_tokens``).
        max_new_tokens: answer length of the calibration prompts.
        cost_tokens: tokens decoded with every candidate shape to time its drafting and loop work.
        cache_dir: where the verification-cost curve is cached.
        ev: the target's answers to ``prompts`` and their aux hidden states, when already built
            (:func:`build_onpolicy_eval` with ``max_new_tokens`` and the drafter's aux layers; e.g.
            shared by the drafters of one benchmark); None builds it here.
        lookup: its prompt-lookup fields go onto every candidate and into the prediction (module
            docstring); None or ``lookup = 0``: no lookup.
        chat: prompts through the chat template (True), as completion prompts (False), or as the
            tokenizer decides (None, :func:`~slimspec_convert.targets.load.resolve_chat`).

    Returns:
        :class:`DraftPlan`.

    Raises:
        ValueError: no calibration prompt, answers too short for the deepest candidate, or an
            ``ev`` of other prompts or other aux layers.
    """
    if not prompts:
        raise ValueError("--draft auto needs at least one calibration prompt")
    t0 = time.perf_counter()
    aux = resolve_aux_layers(drafter.config, model)
    if ev is None:
        ev = build_onpolicy_eval(
            model, tokenizer, list(prompts), aux, max_new_tokens=max_new_tokens, chat=chat
        )
    elif list(ev.prompts) != list(prompts) or tuple(ev.aux_layers) != tuple(aux):
        raise ValueError(
            f"plan_draft_shape: the on-policy set was built for {len(ev.prompts)} other prompts or aux "
            f"layers {tuple(ev.aux_layers)}, the drafter reads {tuple(aux)}"
        )
    prompt_tokens = float(ev.answer_mask.int().argmax(1).float().mean())  # first answer position
    context = 64 * math.ceil((prompt_tokens + max_new_tokens / 2) / 64)
    vc = verify_cost(model, cache_dir, context=context)
    shapes = candidate_shapes(drafter.config.draft_vocab_size)
    depth_max = max(s.depth for s in shapes)
    ranks = chain_ranks(drafter, ev, depth_max)
    looked = None
    if lookup is not None and lookup.lookup:
        fields = {f: getattr(lookup, f) for f in ("lookup", "lookup_min_ngram", "lookup_max_ngram")}
        shapes = [replace(s, **fields) for s in shapes]
        looked = lookup_rounds(ev, depth_max, shapes[0])
    _draft_and_loop_ms(model, tokenizer, drafter, prompts[0], shapes[-1], cost_tokens, chat)  # warm-up
    cands = []
    starts = round_starts(ev, depth_max)  # the columns of ranks and of looked
    for s in shapes:
        if looked is None:
            tau, v = predicted_tau(ranks, s, starts), vc.at(verified_tokens(s))
        else:
            proposed, a_l = looked
            a_d = drafter_accepted(ranks, s)
            accepted = torch.maximum(a_d, a_l)  # the round commits 1 + the longer accepted branch
            seen = visited_round_starts(accepted, starts)
            tau = 1.0 + float(accepted[seen].mean())
            nodes = verified_tokens(s) + proposed[seen] - torch.minimum(a_d, a_l)[seen]
            v = statistics.fmean(vc.at(int(n)) for n in nodes.tolist())
        other = _draft_and_loop_ms(model, tokenizer, drafter, prompts[0], s, cost_tokens, chat)
        cands.append(ShapeCandidate(shape_name(s), asdict(s), tau, v, other, tau / ((v + other) / 1e3)))
    cands.sort(key=lambda c: -c.predicted_tokens_per_s)
    best = DraftConfig(**cands[0].draft)
    plain_shape = replace(best, lookup=0)
    plain_ms = _draft_and_loop_ms(model, tokenizer, None, prompts[0], plain_shape, cost_tokens, chat)
    plain = 1e3 / (vc.at(1) + plain_ms)
    return DraftPlan(best, tuple(cands), plain, vc, len(prompts), time.perf_counter() - t0)
