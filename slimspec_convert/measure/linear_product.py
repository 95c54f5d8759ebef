"""``--linear-product auto``: time the target's verification both ways and keep the faster product.

The target's forward of ``n`` = 1, 2, 3, 4, 6 and 8 tokens after a 128-token context is timed with
torch's ``x @ W.T`` and with ``(W @ x.T).T`` (:mod:`slimspec_convert.targets.linear_product`); the
product with the lower total wins and is set on the target and every drafter. Measured once per
(target, device, dtype, threads, torch) and cached as JSON under ``$SLIMSPEC_CACHE/linear_product``,
with the load it was timed under; a choice timed on a busy machine is timed again on the next run.
Only float32 on the CPU is measured (the slow kernels are MKL's float32 ones); elsewhere ``auto``
keeps torch's product without timing anything.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from slimspec_convert.atomic import atomic_write_json
from slimspec_convert.measure.machine import read_competing_load, timing_machine
from slimspec_convert.measure.verify_cost import (
    measure_verify_cost,
    read_timing_cache,
    timing_cache_path,
    verify_key,
)
from slimspec_convert.targets.linear_product import (
    LINEAR_PRODUCTS,
    TORCH_PRODUCT,
    TRANSPOSED_PRODUCT,
    set_linear_product,
)

logger = logging.getLogger(__name__)

CHOICE_TOKENS = (1, 2, 3, 4, 6, 8)  # verified tokens timed for the choice
CHOICE_CONTEXT = 128


@dataclass(frozen=True)
class LinearProductChoice:
    """Which product the linear layers use, and the timings behind an ``auto`` choice.

    Attributes:
        product: ``torch`` or ``transposed``.
        setting: what was asked (``auto``, ``torch`` or ``transposed``).
        tokens: verified token counts timed (empty when nothing was timed).
        torch_ms, transposed_ms: median ms of one target forward of each count, each product.
        cached: the timings came from the cache file.
    """

    product: str
    setting: str
    tokens: tuple[int, ...] = ()
    torch_ms: tuple[float, ...] = ()
    transposed_ms: tuple[float, ...] = ()
    cached: bool = False

    def summary(self) -> str:
        """One line: the product, and the timings when measured."""
        if not self.tokens:
            why = "as asked" if self.setting != "auto" else "auto: only float32 on the CPU is timed"
            return f"linear product: {self.product} ({why})"
        fmt = "/".join
        counts = fmt(str(n) for n in self.tokens)
        return (
            f"linear product: {self.product} (auto; target forward of {counts} tokens: torch "
            f"{fmt(f'{x:.0f}' for x in self.torch_ms)} ms, transposed "
            f"{fmt(f'{x:.0f}' for x in self.transposed_ms)} ms{', cached' if self.cached else ''})"
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> LinearProductChoice:
        """Inverse of :meth:`to_dict` (lists back to tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def _measure(model) -> tuple[tuple[float, ...], tuple[float, ...]]:
    out = {}
    for product in (TORCH_PRODUCT, TRANSPOSED_PRODUCT):
        set_linear_product(model, product)
        out[product] = measure_verify_cost(model, CHOICE_TOKENS, CHOICE_CONTEXT).ms
    set_linear_product(model, TORCH_PRODUCT)
    return out[TORCH_PRODUCT], out[TRANSPOSED_PRODUCT]


def choose_linear_product(
    model, cache_dir: str | Path | None = None, refresh: bool = False
) -> LinearProductChoice:
    """The faster product for ``model``'s verification forwards (module docstring).

    Chooses only: the model's linear layers are left in torch's product (set it with
    :func:`apply_linear_product` or :func:`~slimspec_convert.targets.linear_product.set_linear_product`).

    Args:
        model: HF causal LM (eval mode), its linear layers in either product.
        cache_dir: folder of the cache files (default ``$SLIMSPEC_CACHE/linear_product``).
        refresh: time again even when a cache file exists.

    Returns:
        :class:`LinearProductChoice`; ``torch`` untimed unless the model is float32 on the CPU.
    """
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return LinearProductChoice(TORCH_PRODUCT, "auto")
    set_linear_product(model, TORCH_PRODUCT)
    key = verify_key(model, CHOICE_CONTEXT)
    path = timing_cache_path(cache_dir, "linear_product", key)
    raw = None if refresh else read_timing_cache(path, key)
    if raw is not None:
        try:
            if tuple(raw["tokens"]) == CHOICE_TOKENS:
                return LinearProductChoice(
                    raw["product"],
                    "auto",
                    CHOICE_TOKENS,
                    tuple(raw["torch_ms"]),
                    tuple(raw["transposed_ms"]),
                    True,
                )
        except (KeyError, TypeError, ValueError):
            logger.warning("%s: unreadable linear-product cache; timing again", path)
    load_before = read_competing_load()
    torch_ms, transposed_ms = _measure(model)
    product = TRANSPOSED_PRODUCT if sum(transposed_ms) < sum(torch_ms) else TORCH_PRODUCT
    choice = LinearProductChoice(product, "auto", CHOICE_TOKENS, torch_ms, transposed_ms)
    machine = timing_machine(load_before, torch.get_num_threads()).to_dict()
    atomic_write_json(path, {**choice.to_dict(), "key": key, "machine": machine})
    return choice


def apply_linear_product(
    model, drafters: Iterable[nn.Module | None], setting: str, cache_dir: str | Path | None = None
) -> LinearProductChoice:
    """Set the target's and the drafters' linear product: ``torch``, ``transposed`` or ``auto``.

    ``auto`` uses :func:`choose_linear_product` (times the target once per machine). The drafters
    follow the target's choice, so plain and speculative decoding run the same kernels.

    Raises:
        ValueError: ``setting`` is not one of ``auto``, ``torch``, ``transposed``.
    """
    if setting not in LINEAR_PRODUCTS:
        raise ValueError(f"linear product {setting!r}: expected one of {', '.join(LINEAR_PRODUCTS)}")
    choice = (
        choose_linear_product(model, cache_dir)
        if setting == "auto"
        else LinearProductChoice(setting, setting)
    )
    for m in (model, *drafters):
        if m is not None:
            set_linear_product(m, choice.product)
    logger.info(choice.summary())
    return choice
