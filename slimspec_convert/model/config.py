"""The drafter's normalised geometry and flags (:class:`DrafterConfig`), whatever dialect it was read from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEFAULT_ROPE_THETA = 10000.0  # EAGLE / SpecForge drafters omit rope_theta (eagle3-formats.md P15)


DEFAULT_RMS_NORM_EPS = 1e-5


AUX_CONVENTION_BOUNDARY = "boundary"  # residual stream after b decoder blocks (vLLM, speculators)


AUX_CONVENTION_OUTPUT_OF = "output_of_layer"  # block o's output, b = o + 1 (SpecForge, SGLang, ModelOpt)


def default_aux_boundaries(num_target_layers: int) -> tuple[int, int, int]:
    """Upstream default capture boundaries {2, L//2, L-3} (eagle3-formats.md section 6).

    Args:
        num_target_layers: L, the target's number of decoder layers (>= 6).

    Returns:
        Three ascending boundary indices.

    Raises:
        ValueError: if L < 6 (the three boundaries would collide).
    """
    if num_target_layers < 6:
        raise ValueError(f"num_target_layers={num_target_layers}: need >= 6 for the default aux layers")
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class DrafterConfig:
    """Normalised geometry and flags of an EAGLE-3 drafter, whatever dialect it was read from.

    The field names follow Hugging Face's LlamaConfig where one exists. ``aux_layer_ids`` are
    always stored as *boundary* indices (eagle3-formats.md section 6); ``aux_layer_ids_source``
    records what the checkpoint declared, for round trips. ``head_is_embedding`` is provenance, not
    geometry: ``convert`` sets it (True when the dense head it factorised was the ``embed_tokens``
    table, row for row), fine-tuning and saving carry it, and ``Eagle3Drafter.enable_rerank``
    refuses a low-rank head unless it is True.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    head_dim: int | None = None
    num_hidden_layers: int = 1
    target_hidden_size: int | None = None
    num_aux_hidden_states: int = 3
    aux_layer_ids: tuple[int, ...] | None = None
    aux_layer_ids_source: str = AUX_CONVENTION_BOUNDARY
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    fc_bias: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output_postnorm: bool = False  # recurrence feeds norm(h) (EAGLE 3.1) instead of h
    has_final_norm: bool = True
    use_aux_hidden_state: bool = True
    head_rank: int | None = None  # None: dense lm_head; int: low-rank W_up @ W_down
    own_embeddings: bool = False  # the checkpoint ships its own embed_tokens (else borrowed from the target)
    source_format: str = "slimspec"
    # Recorded by ``slimspec convert``: the dense head the factors approximate equalled embed_tokens
    # (a tied head). Only then does the shortlist rerank rescore with the right rows. None = not known.
    head_is_embedding: bool | None = None

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "draft_vocab_size",
            "num_hidden_layers",
            "num_aux_hidden_states",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DrafterConfig.{name}={value!r}: expected a positive integer")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"DrafterConfig.draft_vocab_size={self.draft_vocab_size} > vocab_size={self.vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"DrafterConfig.head_dim missing and hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("DrafterConfig: norm_before_fc and fc_norm are mutually exclusive")
        max_rank = min(self.draft_vocab_size, self.hidden_size)
        if self.head_rank is not None and not 1 <= self.head_rank <= max_rank:
            raise ValueError(
                f"DrafterConfig.head_rank={self.head_rank}: expected 1 <= r <= "
                f"min(draft_vocab_size={self.draft_vocab_size}, hidden_size={self.hidden_size})"
            )
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(sorted(int(i) for i in self.aux_layer_ids)))
            if len(self.aux_layer_ids) != self.num_aux_hidden_states:
                raise ValueError(
                    f"DrafterConfig.aux_layer_ids={list(self.aux_layer_ids)} has "
                    f"{len(self.aux_layer_ids)} ids, expected "
                    f"num_aux_hidden_states={self.num_aux_hidden_states}"
                )

    @property
    def resolved_head_dim(self) -> int:
        """head_dim, or d / H when the config omits it (eagle3-formats.md P16)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def resolved_target_hidden_size(self) -> int:
        """dt, the target's hidden width (defaults to d)."""
        return self.target_hidden_size if self.target_hidden_size is not None else self.hidden_size

    @property
    def is_trimmed(self) -> bool:
        """True when the draft vocabulary is smaller than the target's (a ``d2t`` map is needed)."""
        return self.draft_vocab_size < self.vocab_size

    def resolved_aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """Boundary indices to capture from a target with ``num_target_layers`` layers."""
        if self.aux_layer_ids is not None:
            for b in self.aux_layer_ids:
                if not 0 <= b <= num_target_layers:
                    raise ValueError(
                        f"aux layer boundary {b} outside [0, {num_target_layers}] for this target"
                    )
            return self.aux_layer_ids
        return default_aux_boundaries(num_target_layers)

    def replace(self, **changes: Any) -> DrafterConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        out = dataclasses.asdict(self)
        if out["aux_layer_ids"] is not None:
            out["aux_layer_ids"] = list(out["aux_layer_ids"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"DrafterConfig: unknown fields {unknown}")
        return cls(**data)
