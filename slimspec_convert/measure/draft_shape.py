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

The plan also chooses the lookup (``lookups``, by default :data:`AUTO_LOOKUPS`: off or 1-5 tokens): every
shape is timed once without it, every (shape, lookup) pair is predicted with that timing, and the best
predictions whose timing was of the shape without lookup are timed again with their lookup on, until the
best candidate's own timing is in its prediction (:func:`plan_draft_shape`). The decision itself is then
measured (:func:`final_round`): the best predicted candidate without the lookup and the best with it
decode every calibration prompt, and the faster on this machine is the plan. The plan is cached as JSON
under ``$SLIMSPEC_CACHE/draft_plan`` per (target, drafter weights, device, dtype, threads, torch,
calibration prompts, settings), like the verification curve, and is not reused when it was made on a
busy machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from slimspec_convert.atomic import atomic_write_json
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.lookup import lookup_matches
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.measure.chain_acceptance import (
    OnPolicyEval,
    build_onpolicy_eval,
    chain_ranks,
    round_starts,
    visited_round_starts,
)
from slimspec_convert.measure.machine import read_competing_load, timing_machine
from slimspec_convert.measure.verify_cost import (
    VerifyCost,
    read_timing_cache,
    timing_cache_path,
    verify_cost,
    verify_key,
)
from slimspec_convert.targets.forward import resolve_aux_layers
from slimspec_convert.targets.linear_product import linear_product
from slimspec_convert.version import __version__

logger = logging.getLogger(__name__)

AUTO_CALIBRATION_PROMPTS = 4  # prompts the target answers once to measure the drafter's acceptance
AUTO_LOOKUPS = (0, 1, 2, 3, 4, 5)  # prompt-lookup tokens per round the plan chooses among (0 = off)
RETIME_CANDIDATES = 4  # best predictions timed again with their own lookup on, per pass
PLAN_FORMAT = 3  # part of the plan cache key: bump when the planning changes
# The default calibration prompts: held-out *training* prompts (data/README.md), never evaluation ones.
HELDOUT_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "heldout" / "general24.jsonl"
# ... and for a target driven with completion prompts (a base model, no chat template): text to continue,
# four kinds interleaved (prose, code, math, translation), from the training files' held-out split.
HELDOUT_COMPLETION_PROMPTS = HELDOUT_PROMPTS.parent / "gemma3-completions.jsonl"
CHAIN_DEPTHS = (1, 2, 3, 4, 5)
TREE_SHAPES = ((3, 2, 6), (3, 3, 9), (4, 2, 8), (4, 3, 12), (4, 4, 16), (5, 3, 15), (5, 4, 20), (6, 4, 24))


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
    """One (shape, lookup) candidate: predicted tau, the measured costs per round, predicted tokens/s.

    ``timed`` says whether ``draft_and_loop_ms`` was timed with this exact draft (lookup included);
    False: it is the same shape's timing without the lookup, a first estimate (:func:`plan_draft_shape`).
    ``measured_tokens_per_s``: a finalist's tokens/s decoding the calibration prompts (None otherwise).
    """

    shape: str
    draft: dict
    predicted_tau: float
    verify_ms: float
    draft_and_loop_ms: float
    predicted_tokens_per_s: float
    timed: bool = True
    measured_tokens_per_s: float | None = None


@dataclass(frozen=True)
class DraftPlan:
    """What ``--draft auto`` chose and why.

    Attributes:
        draft: the chosen :class:`DraftConfig` (shape and prompt lookup).
        candidates: every candidate, best first.
        plain_tokens_per_s: the target alone, predicted the same way (one token verified per round).
        verify: the verification-cost curve used.
        calibration_prompts: how many prompts gave the acceptance and the costs.
        seconds: time the planning took (reading the cache, when ``cached``).
        cached: read from the plan cache (:func:`plan_draft_shape`) instead of planned now.
        planned_seconds: time the planning took when it was made (equals ``seconds`` unless cached).
    """

    draft: DraftConfig
    candidates: tuple[ShapeCandidate, ...]
    plain_tokens_per_s: float
    verify: VerifyCost
    calibration_prompts: int
    seconds: float
    cached: bool = False
    planned_seconds: float | None = None

    @property
    def best(self) -> ShapeCandidate:
        return self.candidates[0]

    def summary(self) -> str:
        """One line: the shape picked, its prediction against plain decoding, the runners-up, the cost."""
        b = self.best
        cost = (
            f"cached plan, {self.seconds:.1f} s (planned in {self.planned_seconds or 0:.0f} s)"
            if self.cached
            else f"planned in {self.seconds:.0f} s on {self.calibration_prompts} calibration prompts"
        )
        others = [c for c in self.candidates[1:] if c.measured_tokens_per_s is not None]
        measured = (
            f"; measured on the calibration prompts {b.measured_tokens_per_s:.1f} tokens/s against "
            + ", ".join(f"{c.shape} {c.measured_tokens_per_s:.1f}" for c in others)
            if b.measured_tokens_per_s is not None and others
            else ""
        )
        return (
            f"--draft auto: {b.shape} (predicted tau {b.predicted_tau:.2f}, {b.predicted_tokens_per_s:.1f} "
            f"tokens/s; plain decoding {self.plain_tokens_per_s:.1f}{measured}); runner-up "
            + ", ".join(f"{c.shape} {c.predicted_tokens_per_s:.1f}" for c in self.candidates[1:4])
            + f"; {cost}"
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
            "cached": self.cached,
            "planned_seconds": self.planned_seconds,
        }

    @classmethod
    def from_dict(cls, raw: dict) -> DraftPlan:
        """The plan :meth:`to_dict` wrote.

        Raises:
            KeyError, TypeError, ValueError: a dict of another form.
        """
        v = raw["verify"]
        return cls(
            draft=DraftConfig(**raw["draft"]),
            candidates=tuple(ShapeCandidate(**c) for c in raw["candidates"]),
            plain_tokens_per_s=float(raw["plain_tokens_per_s"]),
            verify=VerifyCost(tuple(v["tokens"]), tuple(v["ms"]), int(v["context"]), v["key"]),
            calibration_prompts=int(raw["calibration_prompts"]),
            seconds=float(raw["seconds"]),
            cached=bool(raw.get("cached", False)),
            planned_seconds=raw.get("planned_seconds"),
        )


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


def default_calibration_file(chat: bool) -> Path:
    """The held-out training prompts ``--draft auto`` plans on without ``--auto-prompts``:
    :data:`HELDOUT_PROMPTS` for a chat target, :data:`HELDOUT_COMPLETION_PROMPTS` for one driven with
    completion prompts (never evaluation prompts: data/README.md)."""
    return HELDOUT_PROMPTS if chat else HELDOUT_COMPLETION_PROMPTS


def calibration_prompts(
    path: str | Path | None = None, num: int = AUTO_CALIBRATION_PROMPTS, chat: bool = True
) -> list[str]:
    """The calibration prompts of ``--draft auto``: ``num`` first turns spread evenly over a prompt file.

    Args:
        path: JSONL prompts (:func:`~slimspec_convert.decoding.prompts.load_prompts`); None: held-out
            training prompts (never evaluation prompts: data/README.md), :data:`HELDOUT_PROMPTS` for a
            chat target, :data:`HELDOUT_COMPLETION_PROMPTS` for one driven with completion prompts.
        num: how many; the first and the last prompt of the file are always among them.
        chat: the target's prompt mode (:func:`~slimspec_convert.targets.load.resolve_chat`); picks the
            default file.

    Returns:
        Up to ``num`` prompts, in file order.

    Raises:
        FileNotFoundError: the file is missing (the default ships with the git checkout, not a wheel).
        ValueError: a file with no prompt, or ``num < 1``.
    """
    if num < 1:
        raise ValueError(f"calibration prompts: num={num}, expected >= 1")
    default = default_calibration_file(chat)
    if path is None and not default.is_file():
        raise FileNotFoundError(
            f"--draft auto: the held-out calibration prompts {default} are missing (they ship with "
            "the git checkout, not with a wheel); pass --auto-prompts FILE.jsonl or a shape (--draft chain)"
        )
    prompts = [t[0] for t in load_prompts(default if path is None else path)]
    if not prompts:
        raise ValueError(f"{path or default}: no prompt to calibrate --draft auto on")
    if len(prompts) <= num:
        return prompts
    picks = sorted({round(i * (len(prompts) - 1) / (num - 1)) for i in range(num)}) if num > 1 else [0]
    return [prompts[i] for i in picks]


def draft_and_loop_ms(
    model, tokenizer, drafter, prompt: str, d: DraftConfig, new_tokens: int, chat: bool | None = None
) -> float:
    """Milliseconds per round outside the target's forward: drafting plus the loop's own work.

    Decodes ``prompt`` greedily for ``new_tokens`` tokens with draft ``d`` (``drafter`` None: the
    target alone, with ``d``'s lookup) and subtracts the target's forward time from the wall time.
    ``chat``: the prompt through the chat template (True), as a completion prompt (False), or as the
    tokenizer decides (None).
    """
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    gen = SpeculativeGenerator(model, tokenizer, drafter, d, sampling, chat=chat)
    t0 = time.perf_counter()
    res = gen.generate([prompt])[0]
    wall = (time.perf_counter() - t0) * 1e3
    return (wall - res.stats.target_ms) / max(1, res.stats.cycles)


def drafter_fingerprint(drafter) -> str:
    """A 16-hex hash of everything about ``drafter`` that its plan depends on.

    Its config, every tensor of its state dict (name, dtype, shape, bytes; the borrowed target rows
    included), the shortlist rerank of a low-rank head and its linear product. Hashing reads every
    byte once (about 0.1 s per 100 MB).
    """
    h = hashlib.sha256(repr(drafter.config).encode())
    head = drafter.lm_head
    h.update(repr((getattr(head, "rerank_k", 0), getattr(head, "rerank_context", 0))).encode())
    h.update(linear_product(drafter).encode())
    for name, t in sorted(drafter.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def plan_key(model, drafter, prompts: Sequence[str], settings: dict) -> dict:
    """What a cached plan is of: the target (:func:`verify_key` without the context), the drafter
    (:func:`drafter_fingerprint`), the calibration prompts, the planning settings and versions."""
    target = {k: v for k, v in verify_key(model, 0).items() if k != "context"}
    prompt_hash = hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest()[:16]
    return {
        "format": PLAN_FORMAT,
        "slimspec": __version__,
        "target": target,
        "drafter": drafter_fingerprint(drafter),
        "prompts": prompt_hash,
        **settings,
    }


def plan_draft_shape(
    model,
    tokenizer,
    drafter,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    cost_tokens: int = 16,
    cache_dir: str | Path | None = None,
    ev: OnPolicyEval | Callable[[], OnPolicyEval] | None = None,
    lookup: DraftConfig | None = None,
    lookups: Sequence[int] | None = None,
    cache: bool = True,
    chat: bool | None = None,
) -> DraftPlan:
    """Pick the draft shape and prompt lookup with the highest predicted greedy tokens/s (module docstring).

    Args:
        model: the target (eval mode), on its device and dtype.
        tokenizer: its tokenizer.
        drafter: the drafter, on the same device and dtype.
        prompts: calibration prompts (a few: each is answered by the target once, ``max_new_tokens``).
        max_new_tokens: answer length of the calibration prompts.
        cost_tokens: tokens decoded with every timed candidate to time its drafting and loop work.
        cache_dir: folder of the caches (default ``$SLIMSPEC_CACHE``): the verification-cost curve in
            ``verify_cost/``, the plan in ``draft_plan/``.
        ev: the target's answers to ``prompts`` and their aux hidden states, when already built
            (:func:`build_onpolicy_eval` with ``max_new_tokens`` and the drafter's aux layers; e.g.
            shared by the drafters of one benchmark), or a function that builds them (called only when
            no cached plan is found); None builds them here.
        lookup: its n-gram fields (``lookup_min_ngram``, ``lookup_max_ngram``) go onto every candidate;
            with ``lookups`` None its ``lookup`` is the one lookup planned with (None or 0: none).
        lookups: the prompt-lookup token counts to choose among (0 = off), e.g. :data:`AUTO_LOOKUPS`.
        cache: read a cached plan of the same key (one made on a quiet machine) and write this one.
        chat: prompts through the chat template (True), as completion prompts (False), or as the
            tokenizer decides (None, :func:`~slimspec_convert.targets.load.resolve_chat`).

    Returns:
        :class:`DraftPlan`.

    Raises:
        ValueError: no calibration prompt, a negative lookup, answers too short for the deepest
            candidate, or an ``ev`` of other prompts or other aux layers.
    """
    if not prompts:
        raise ValueError("--draft auto needs at least one calibration prompt")
    t0 = time.perf_counter()
    grams = lookup or DraftConfig()
    ks = tuple(sorted(set(lookups if lookups is not None else ((lookup.lookup if lookup else 0),))))
    if not ks or ks[0] < 0:
        raise ValueError(f"plan_draft_shape: lookups={ks}, expected token counts >= 0 (0 = off)")
    settings = dict(
        chat=chat,
        max_new_tokens=max_new_tokens,
        cost_tokens=cost_tokens,
        lookups=list(ks),
        lookup_min_ngram=grams.lookup_min_ngram,
        lookup_max_ngram=grams.lookup_max_ngram,
    )
    key = plan_key(model, drafter, prompts, settings) if cache else {}
    path = timing_cache_path(cache_dir and Path(cache_dir) / "draft_plan", "draft_plan", key)
    raw = read_timing_cache(path, key) if cache else None
    if raw is not None:
        try:
            plan = DraftPlan.from_dict(raw["plan"])
            return replace(plan, cached=True, seconds=time.perf_counter() - t0)
        except (KeyError, TypeError, ValueError):
            logger.warning("%s: unreadable draft plan cache; planning again", path)
    load_before = read_competing_load()
    plan = _plan(
        model, tokenizer, drafter, list(prompts), ks, grams, max_new_tokens, cost_tokens, cache_dir, ev, chat
    )
    seconds = time.perf_counter() - t0
    plan = replace(plan, seconds=seconds, planned_seconds=seconds)
    if cache:
        machine = timing_machine(load_before, torch.get_num_threads()).to_dict()
        atomic_write_json(path, {"key": key, "plan": plan.to_dict(), "machine": machine})
    return plan


def _plan(model, tokenizer, drafter, prompts, ks, grams, max_new_tokens, cost_tokens, cache_dir, ev, chat):
    """The planning of :func:`plan_draft_shape` (no plan cache)."""
    aux = resolve_aux_layers(drafter.config, model)
    if callable(ev):
        ev = ev()
    if ev is None:
        ev = build_onpolicy_eval(model, tokenizer, prompts, aux, max_new_tokens=max_new_tokens, chat=chat)
    elif list(ev.prompts) != list(prompts) or tuple(ev.aux_layers) != tuple(aux):
        raise ValueError(
            f"plan_draft_shape: the on-policy set was built for {len(ev.prompts)} other prompts or aux "
            f"layers {tuple(ev.aux_layers)}, the drafter reads {tuple(aux)}"
        )
    prompt_tokens = float(ev.answer_mask.int().argmax(1).float().mean())  # first answer position
    context = 64 * math.ceil((prompt_tokens + max_new_tokens / 2) / 64)
    vc = verify_cost(model, cache_dir and Path(cache_dir) / "verify_cost", context=context)
    shapes = candidate_shapes(drafter.config.draft_vocab_size)
    depth_max = max(s.depth for s in shapes)
    ranks = chain_ranks(drafter, ev, depth_max)
    starts = round_starts(ev, depth_max)  # the columns of ranks and of the lookup rounds
    fields = {"lookup_min_ngram": grams.lookup_min_ngram, "lookup_max_ngram": grams.lookup_max_ngram}
    shapes = [replace(s, **fields) for s in shapes]

    def timed(d: DraftConfig) -> float:
        return draft_and_loop_ms(model, tokenizer, drafter, prompts[0], d, cost_tokens, chat)

    def predict(d: DraftConfig, other: float, exact: bool) -> ShapeCandidate:
        if not d.lookup:
            tau, v = predicted_tau(ranks, d, starts), vc.at(verified_tokens(d))
        else:
            proposed, a_l = looked[d.lookup]
            a_d = drafter_accepted(ranks, d)
            accepted = torch.maximum(a_d, a_l)  # the round commits 1 + the longer accepted branch
            seen = visited_round_starts(accepted, starts)
            tau = 1.0 + float(accepted[seen].mean())
            nodes = verified_tokens(d) + proposed[seen] - torch.minimum(a_d, a_l)[seen]
            v = statistics.fmean(vc.at(int(n)) for n in nodes.tolist())
        return ShapeCandidate(shape_name(d), asdict(d), tau, v, other, tau / ((v + other) / 1e3), exact)

    looked = {k: lookup_rounds(ev, depth_max, replace(shapes[0], lookup=k)) for k in ks if k}
    timed(replace(shapes[-1], lookup=ks[-1]))  # warm-up
    base = {s: timed(replace(s, lookup=ks[0])) for s in shapes}  # each shape once, at the first lookup
    cands = [predict(replace(s, lookup=k), base[s], k == ks[0]) for s in shapes for k in ks]
    cands.sort(key=lambda c: -c.predicted_tokens_per_s)
    while True:  # time the best estimates with their own lookup until the best with a lookup is timed
        lead = next((c for c in cands if c.draft["lookup"]), None)
        if lead is None or lead.timed:
            break
        todo = [c for c in cands if not c.timed][:RETIME_CANDIDATES]
        for c in todo:
            d = DraftConfig(**c.draft)
            cands[cands.index(c)] = predict(d, timed(d), True)
        cands.sort(key=lambda c: -c.predicted_tokens_per_s)
    cands = final_round(model, tokenizer, drafter, prompts, cands, max_new_tokens, chat)
    best = DraftConfig(**cands[0].draft)
    plain_shape = replace(best, lookup=0)
    plain_ms = draft_and_loop_ms(model, tokenizer, None, prompts[0], plain_shape, cost_tokens, chat)
    plain = 1e3 / (vc.at(1) + plain_ms)
    return DraftPlan(best, tuple(cands), plain, vc, len(prompts), 0.0)


def final_round(
    model, tokenizer, drafter, prompts, cands: list[ShapeCandidate], max_new_tokens: int, chat: bool | None
) -> list[ShapeCandidate]:
    """The lookup decision, measured: the best predicted candidate without the lookup and the best with
    it decode every calibration prompt (``max_new_tokens``, greedy, in turn per prompt so that machine
    noise hits both alike), and the one with more tokens/s goes first.

    Returns:
        ``cands`` with the finalists first (their ``measured_tokens_per_s`` set, faster first), then the
        rest in predicted order; unchanged when all candidates share one lookup setting.
    """
    finalists = []
    for with_lookup in (False, True):
        finalists += [c for c in cands if bool(c.draft["lookup"]) == with_lookup][:1]
    if len(finalists) < 2:
        return cands
    samplings = SamplingConfig(max_new_tokens=max_new_tokens)
    gens = [
        SpeculativeGenerator(model, tokenizer, drafter, DraftConfig(**c.draft), samplings, chat=chat)
        for c in finalists
    ]
    tokens, seconds = [0] * len(gens), [0.0] * len(gens)
    for n, prompt in enumerate(prompts):
        for i in range(len(gens)):
            k = (i + n) % len(gens)  # the order rotates per prompt
            t0 = time.perf_counter()
            res = gens[k].generate([prompt])[0]
            seconds[k] += time.perf_counter() - t0
            tokens[k] += res.stats.new_tokens
    done = [
        replace(c, measured_tokens_per_s=t / s) for c, t, s in zip(finalists, tokens, seconds, strict=True)
    ]
    done.sort(key=lambda c: -c.measured_tokens_per_s)
    return done + [c for c in cands if c not in finalists]
