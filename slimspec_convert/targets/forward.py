"""Target adapter: any Hugging Face causal LM -> logits plus the aux hidden states an EAGLE-3
drafter was trained on (eagle3-formats.md sections 5.1 and 6).

Aux states are read from ``output_hidden_states``: HF's ``hidden_states[b]`` is the residual
stream after ``b`` decoder blocks, i.e. *boundary* index ``b`` (``b = 0`` is the embedding output).
For ``b = L`` HF returns the post-final-norm state, while engines capture it before the norm; we
therefore refuse ``b = L`` rather than feed a different feature.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from slimspec_convert.targets.load import num_target_layers

logger = logging.getLogger(__name__)


@dataclass
class TargetOutput:
    """One target forward.

    Attributes:
        logits: [B, T, V_t] float32.
        aux_hidden: [B, T, K*dt], concatenated in ascending boundary order, model dtype.
        past_key_values: the HF cache after this call (None when not requested).
        final_hidden: [B, T, dt] the last layer's output after the final norm (the lm_head input),
            so logits at selected positions can be computed later with :func:`target_logits_at`.
        final_lse: [B, T] float32 ``logsumexp`` of the logits at every position, when known (a
            feature cache stores it), so log-probabilities of a few rows need only those rows' products.
    """

    logits: Tensor
    aux_hidden: Tensor
    past_key_values: object | None = None
    final_hidden: Tensor | None = None
    final_lse: Tensor | None = None


def check_aux_layers(boundaries: tuple[int, ...], num_layers: int) -> None:
    """Validate boundary ids against the target (0 <= b < L; see module docstring for b = L).

    Raises:
        ValueError: naming the bad id.
    """
    for b in boundaries:
        if not 0 <= b < num_layers:
            raise ValueError(
                f"aux layer boundary {b} is outside [0, {num_layers - 1}] for this {num_layers}-layer target"
            )


def resolve_aux_layers(drafter_config, model) -> tuple[int, ...]:
    """The boundary ids a drafter reads from this target, checked (the one aux-layer resolver).

    Args:
        drafter_config: the drafter's ``DrafterConfig`` (its ``aux_layer_ids``, boundaries, or None
            for the upstream default ``{2, L//2, L-3}``, eagle3-formats.md section 6).
        model: the HF target.

    Returns:
        Ascending boundary ids, each in ``[0, L)``.

    Raises:
        ValueError: an id outside the target's layers (naming it).
    """
    num_layers = num_target_layers(model)
    if drafter_config.aux_layer_ids is None:
        logger.warning(
            "drafter config has no aux layer ids; using the upstream default boundaries %s of this "
            "%d-layer target (EAGLE-3's {2, L//2, L-3}). Acceptance is poor if the drafter was "
            "trained on other layers.",
            drafter_config.resolved_aux_layer_ids(num_layers),
            num_layers,
        )
    aux = tuple(drafter_config.resolved_aux_layer_ids(num_layers))
    check_aux_layers(aux, num_layers)
    return aux


def target_forward(
    model,
    input_ids: Tensor,
    aux_layers: tuple[int, ...],
    *,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values=None,
    use_cache: bool = False,
    logits_to_keep: int | None = None,
) -> TargetOutput:
    """Run the target once and capture its aux hidden states.

    Args:
        model: HF causal LM.
        input_ids: [B, T] int64.
        aux_layers: boundary indices (ascending).
        attention_mask: [B, S] 0/1 padding mask, or a 4-D mask HF accepts.
        position_ids: [B, T] int64.
        past_key_values: HF cache to extend.
        use_cache: return the updated cache.
        logits_to_keep: compute logits only for the last N positions (memory).

    Returns:
        :class:`TargetOutput`.
    """
    cache_kw = cache_kwarg(model)
    kwargs = {cache_kw: past_key_values}
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        output_hidden_states=True,
        return_dict=True,
        **kwargs,
    )
    aux = torch.cat([out.hidden_states[b] for b in sorted(aux_layers)], dim=-1)  # [B, T, K*dt]
    return TargetOutput(
        logits=out.logits.float(),
        aux_hidden=aux,
        past_key_values=getattr(out, cache_kw),
        final_hidden=out.hidden_states[-1],
    )


_CACHE_KWARGS: dict[type, str] = {}


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument and output field: ``cache`` (transformers >= 5.x; the older
    ``past_key_values`` is deprecated there and goes in 5.40) or ``past_key_values`` (4.x)."""
    cls = type(model)
    if cls not in _CACHE_KWARGS:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KWARGS[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARGS[cls]


def target_logits_at(model, final_hidden: Tensor, head=None) -> Tensor:
    """Target logits for already gathered final hidden states.

    Args:
        model: HF causal LM.
        final_hidden: [..., dt] post-final-norm hidden states (``TargetOutput.final_hidden``), any
            float dtype (cast to the output embedding's).
        head: a callable standing in for the model's output embedding (e.g. a bf16 product);
            None uses ``model.get_output_embeddings()``.

    Returns:
        [..., V_t] float32 (applies any final logit soft-capping the model config declares).
    """
    if head is None:
        head = model.get_output_embeddings()
        final_hidden = final_hidden.to(head.weight.dtype)  # e.g. float32 cached features, bf16 target
    logits = head(final_hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
