"""How a model's ``nn.Linear`` layers multiply on the CPU: torch's ``x @ W.T`` or ``(W @ x.T).T``.

Why: verification forwards a handful of tokens, so every linear layer is a product of a few rows of
activations ``x`` [N, in] (N = 2..8) with a large weight ``W`` [out, in]. For such shapes some CPU
BLAS builds pick a slow float32 kernel: with the MKL inside torch's CPU wheels on an AMD EPYC, the
target's lm_head product ``x @ W.T`` (W [49152, 576]) takes 26 ms for N = 2 and 38 ms for N = 3
against 12 ms for N = 1, so verifying 2-3 tokens cost 1.6-1.9x a plain decoding step, while the
same product written ``(W @ x.T).T`` takes 3.7 ms and 7.5 ms, and one row multiplied as two (the row
twice, one result kept) 3.5 ms. Over the whole target (float32, 2 threads, 128 cached tokens) a
forward of 1/2/3/4/8 tokens took 75/140/164/129/114 ms the torch way and 49/66/76/75/124 ms the
transposed way. Both plain decoding (one token a step) and verification get faster; speculation
pays when verifying k tokens costs about one plain step, so the choice is measured per machine
(:func:`slimspec_convert.measure.linear_product.choose_linear_product`) and applied to the target and
the drafter alike, so plain decoding and speculative decoding are timed with the same kernels.

Both products compute the same sums in float32 and may round differently in the last bits, as any
two BLAS kernels do (and as torch's own kernels do between 1 and k rows). The lossless checks
compare plain and speculative decoding run with the same choice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

LINEAR_PRODUCTS = ("auto", "torch", "transposed")
TORCH_PRODUCT = "torch"
TRANSPOSED_PRODUCT = "transposed"


class TransposedLinear(nn.Linear):
    """``nn.Linear`` whose forward computes ``(W @ x.T).T + b`` (same parameters, same state dict).

    A single row is multiplied as two equal columns and one result kept (the one-column kernel is
    the slow one); the output is the same.

    Args of forward:
        x: [..., in_features], the weight's dtype.

    Returns:
        [..., out_features], contiguous, same dtype.
    """

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102 (documented on the class)
        rows = x.reshape(-1, self.in_features)  # [N, in]
        if rows.shape[0] == 1:  # one row goes as two: the BLAS's one-column kernel is the slow one
            pair = torch.cat([rows, rows]).t()  # [in, 2]
            y = torch.mm(self.weight, pair)[:, :1].t().contiguous()  # [out, 2] -> [1, out]
        else:
            y = torch.mm(self.weight, rows.t()).t().contiguous()  # [out, N] -> [N, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def check_linear_product(owner: str, value: str) -> None:
    """Raise ``ValueError`` naming ``owner.linear_product`` unless ``value`` is in :data:`LINEAR_PRODUCTS`."""
    if value not in LINEAR_PRODUCTS:
        raise ValueError(f"{owner}.linear_product={value!r}: expected one of {', '.join(LINEAR_PRODUCTS)}")


def set_linear_product(model: nn.Module, product: str) -> int:
    """Make every ``nn.Linear`` of ``model`` multiply the ``torch`` way or the ``transposed`` way.

    Swaps the class of each module (``nn.Linear`` <-> :class:`TransposedLinear`), so parameters,
    hooks, ``isinstance(m, nn.Linear)`` and the state dict are untouched. Subclasses of
    ``nn.Linear`` other than these two (quantised or adapter layers) are left alone.

    Args:
        model: any module (an HF target, a drafter).
        product: ``torch`` or ``transposed``.

    Returns:
        The number of linear layers now using ``product``.

    Raises:
        ValueError: ``product`` is not ``torch`` or ``transposed``.
    """
    if product not in (TORCH_PRODUCT, TRANSPOSED_PRODUCT):
        raise ValueError(f"linear product {product!r}: expected 'torch' or 'transposed'")
    cls = nn.Linear if product == TORCH_PRODUCT else TransposedLinear
    n = 0
    for m in model.modules():
        if type(m) in (nn.Linear, TransposedLinear):
            m.__class__ = cls
            n += 1
    return n


def linear_product(model: nn.Module) -> str:
    """``transposed`` when any linear layer of ``model`` is a :class:`TransposedLinear`, else ``torch``."""
    return TRANSPOSED_PRODUCT if any(type(m) is TransposedLinear for m in model.modules()) else TORCH_PRODUCT
