"""The target's verification time against the tokens verified in one forward, and the timing cache.

``T_verify(n)`` of :mod:`~slimspec_convert.measure.draft_shape`: the target's forward of ``n`` new tokens
after a context of cached ones, measured once per (target, device, dtype, threads, torch, context,
linear product) and cached as JSON under ``$SLIMSPEC_CACHE/verify_cost`` (:func:`verify_cost`). On CPUs
it grows with the tokens (SmolLM2 on 2 cores, float32, 128-token context: 54 ms for 1 or 2, 78 for 4,
125 for 16), which is why trees that pay on GPUs do not here. :func:`timing_cache_path` and
:func:`read_timing_cache` are the one timing cache of the package (also the linear product's and the
draft plan's): a figure timed on a busy machine is never reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from slimspec_convert.atomic import atomic_write_json
from slimspec_convert.devices import clock_ms
from slimspec_convert.measure.machine import read_competing_load, timing_machine
from slimspec_convert.targets.cache import keep_cache_slots, new_target_cache
from slimspec_convert.targets.forward import cache_kwarg
from slimspec_convert.targets.linear_product import linear_product

logger = logging.getLogger(__name__)

VERIFY_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
VERIFY_CONTEXT = 256  # cached tokens before the verified ones, unless the plan gives its own
VERIFY_TIMING = "interleaved-fastest"  # how the curve is timed (cache key: others are timed anew)


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
    kw = cache_kwarg(model)
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
    load_before = read_competing_load()
    vc = measure_verify_cost(model, context=context)
    atomic_write_json(
        path, {**vc.to_dict(), "machine": timing_machine(load_before, torch.get_num_threads()).to_dict()}
    )
    return vc
