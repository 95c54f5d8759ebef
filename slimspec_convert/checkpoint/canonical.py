"""Canonical tensors of a drafter checkpoint and the report of how they were found (I/O layer data).

Canonical names are :class:`~slimspec_convert.model.drafter.Eagle3Drafter`'s state-dict keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from slimspec_convert.checkpoint.weightfiles import TensorRef
from slimspec_convert.model.config import DrafterConfig


@dataclass(eq=False)
class CanonicalTensor:
    """One tensor of the canonical state dict and where it comes from.

    Attributes:
        key: canonical name.
        ref: the file tensor it is read from (None when computed or borrowed).
        rows: (start, stop) rows of ``ref`` when it is part of a fused vLLM tensor.
        value: the tensor itself when computed here or borrowed from the target.
        origin: human-readable provenance for the :class:`LoadReport`.
    """

    key: str
    ref: TensorRef | None = None
    rows: tuple[int, int] | None = None
    value: Tensor | None = None
    origin: str = ""

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the canonical tensor."""
        if self.value is not None:
            return tuple(self.value.shape)
        if self.rows is not None:
            return (self.rows[1] - self.rows[0], *self.ref.shape[1:])
        return self.ref.shape

    @property
    def dtype(self) -> torch.dtype:
        """Dtype as stored."""
        return self.value.dtype if self.value is not None else self.ref.dtype

    @property
    def raw(self) -> TensorRef | None:
        """The file tensor when it can be copied byte for byte (not sliced, not computed)."""
        return self.ref if self.value is None and self.rows is None else None

    def view(self) -> Tensor:
        """Zero-copy view where possible (memory-mapped file tensor, or a row slice of one)."""
        if self.value is not None:
            return self.value
        t = self.ref.view()
        return t[self.rows[0] : self.rows[1]] if self.rows is not None else t

    def load(self) -> Tensor:
        """A tensor owning its memory."""
        if self.value is not None:
            return self.value
        if self.rows is None:
            return self.ref.load()
        return self.view().clone()


@dataclass
class LoadReport:
    """What the loader read, from where, and every assumption it made.

    Attributes:
        path: checkpoint folder.
        source_format: one of :data:`FORMATS`.
        evidence: why that format was chosen.
        files: weight files read.
        file_bytes: their total size.
        config: the normalised :class:`DrafterConfig`.
        tensors: canonical key -> provenance (``file: 'key'``, a row slice, rebuilt, or borrowed).
        borrowed: canonical keys taken from the target (e.g. ``embed_tokens.weight``).
        rebuilt: canonical keys computed here (e.g. ``t2d`` from ``d2t``).
        ignored: file keys deliberately not loaded -> why (an explicit allow-list).
        aux_layer_ids_declared: ids as written in config.json (None: absent, upstream default).
        aux_layer_ids_convention: how they were read ("boundary" / "output_of_layer" / None).
        norm_output_semantics: how ``norm_output`` was read ("specforge" / "engine" / None if absent).
        warnings: config/tensor disagreements resolved in favour of the tensors, and defaults assumed.
        dtypes: float dtype -> number of tensors.
        num_params: parameters in the file(s) excluding ``embed_tokens`` and ``d2t``/``t2d``.
    """

    path: str
    source_format: str
    evidence: list[str]
    files: list[str]
    file_bytes: int
    config: DrafterConfig
    tensors: dict[str, str] = field(default_factory=dict)
    borrowed: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)
    aux_layer_ids_declared: list[int] | None = None
    aux_layer_ids_convention: str | None = None
    norm_output_semantics: str | None = None
    warnings: list[str] = field(default_factory=list)
    dtypes: dict[str, int] = field(default_factory=dict)
    num_params: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the config as a dict)."""
        out = dict(self.__dict__)
        out["config"] = self.config.to_dict()
        return out

    def summary(self) -> str:
        """Aligned two-column text table of the main facts."""
        c = self.config
        head = "dense" if c.head_rank is None else f"low-rank r={c.head_rank}"
        aux = (
            "default boundaries {2, L//2, L-3}"
            if c.aux_layer_ids is None
            else (
                f"boundaries {list(c.aux_layer_ids)} (declared {self.aux_layer_ids_declared} as "
                f"{self.aux_layer_ids_convention})"
            )
        )
        rows = [
            ("path", self.path),
            ("source_format", self.source_format),
            ("files", ", ".join(Path(f).name for f in self.files)),
            ("file_bytes", f"{self.file_bytes:,}"),
            ("hidden_size d", str(c.hidden_size)),
            ("vocab V_t / draft V_d", f"{c.vocab_size} / {c.draft_vocab_size}"),
            ("lm_head", f"{head}, {c.draft_vocab_size} rows"),
            (
                "layers / heads / kv / head_dim",
                f"{c.num_hidden_layers} / {c.num_attention_heads} / "
                f"{c.num_key_value_heads} / {c.resolved_head_dim}",
            ),
            ("aux layers", aux),
            ("norm_before_fc / fc_norm", f"{c.norm_before_fc} / {c.fc_norm}"),
            ("norm_before_residual", str(c.norm_before_residual)),
            ("recurrence", "post-norm (EAGLE 3.1)" if c.norm_output_postnorm else "pre-norm"),
            ("final norm", str(c.has_final_norm)),
            ("rope", f"theta={c.rope_theta}, scaling={c.rope_scaling}"),
            ("params (no embedding)", f"{self.num_params:,}"),
            ("dtypes", ", ".join(f"{k} x{v}" for k, v in self.dtypes.items())),
            ("borrowed from target", ", ".join(self.borrowed) or "-"),
            ("rebuilt", ", ".join(self.rebuilt) or "-"),
            ("ignored", ", ".join(f"{k} ({v})" for k, v in self.ignored.items()) or "-"),
        ]
        rows += [("warning", w) for w in self.warnings]
        return _table(rows)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


@dataclass
class ResolvedCheckpoint:
    """A checkpoint mapped onto canonical names, nothing read but headers and the vocab maps.

    Attributes:
        config: normalised drafter config.
        tensors: canonical key -> tensor source, in :class:`Eagle3Drafter` state-dict order.
        report: the :class:`LoadReport`.
        head_missing: the file has no lm_head (engines then share the target's, P12 / P20).
    """

    config: DrafterConfig
    tensors: dict[str, CanonicalTensor]
    report: LoadReport
    head_missing: bool = False
