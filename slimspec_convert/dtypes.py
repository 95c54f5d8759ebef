"""The one dtype-name table: names users type (CLI, configs) -> torch dtypes.

Every option that takes a dtype accepts the long torch names and the short ones (``float32``/``fp32``,
``bfloat16``/``bf16``, ``float16``/``fp16``).
"""

from __future__ import annotations

import torch

DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def check_dtype_name(owner: str, dtype: str) -> None:
    """Raise unless ``dtype`` is a name in :data:`DTYPES`.

    Args:
        owner: what holds the value, for the message (e.g. ``"GenerateConfig"``).
        dtype: the name given.

    Raises:
        ValueError: ``{owner}.dtype=...: expected one of [...]``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"{owner}.dtype={dtype!r}: expected one of {sorted(DTYPES)}")


def torch_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """The torch dtype of a name in :data:`DTYPES` (a torch dtype passes through; None gives ``default``).

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return default
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)}")
    return getattr(torch, DTYPES[name])
