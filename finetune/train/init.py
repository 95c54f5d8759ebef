"""Initialising a new EAGLE-3 drafter for a target (embeddings and head from the target, aux layers)."""

from __future__ import annotations

import torch
from torch import nn

from slimspec_convert.model.config import DrafterConfig, default_aux_boundaries
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.vocab import draft_to_target_ids, trimmed_vocab_from_counts
from slimspec_convert.target.load import num_target_layers, target_embeddings, target_lm_head


def new_drafter_for_target(
    target_model, draft_vocab_size: int | None = None, counts: torch.Tensor | None = None, seed: int = 0
) -> Eagle3Drafter:
    """A fresh EAGLE-3 drafter shaped after the target (one decoder layer of the target's geometry).

    Initialisation: embeddings and lm_head from the target (rows ``d2t`` + arange when trimmed);
    ``fc`` picks the highest aux state (``[0 | 0 | I]``), so before any training the drafter is a
    logit lens on layer ``L-3`` (final norm copied from the target); the decoder layer is random
    (std 0.02) with its output projections zeroed, so it starts as the identity on the residual stream.

    Args:
        target_model: HF causal LM (Llama-family geometry).
        draft_vocab_size: trimmed draft vocabulary size, or None for the full vocabulary.
        counts: [V_t] token counts used to pick the kept ids when trimmed.
        seed: initialisation seed.

    Returns:
        The drafter, float32, with ``aux_layer_ids`` = the upstream default boundaries.
    """
    tc = target_model.config
    V = int(tc.vocab_size)
    L = num_target_layers(target_model)
    rope = getattr(tc, "rope_parameters", None) or {}
    cfg = DrafterConfig(
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        num_attention_heads=int(tc.num_attention_heads),
        num_key_value_heads=int(tc.num_key_value_heads),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads),
        vocab_size=V,
        draft_vocab_size=draft_vocab_size or V,
        aux_layer_ids=default_aux_boundaries(L),
        rms_norm_eps=float(tc.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
        max_position_embeddings=int(tc.max_position_embeddings),
        source_format="slimspec-train-drafter",
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    d = cfg.hidden_size
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            else:
                p.fill_(1.0)
        drafter.midlayer.self_attn.o_proj.weight.zero_()
        drafter.midlayer.mlp.down_proj.weight.zero_()
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, 2 * d : 3 * d] = torch.eye(d)
        drafter.embed_tokens.weight.copy_(target_embeddings(target_model).float())
        target_norm = getattr(getattr(target_model, "model", None), "norm", None)
        if target_norm is not None and tuple(target_norm.weight.shape) == (d,):
            drafter.norm.weight.copy_(target_norm.weight.float())  # logit lens uses the target's final norm
        head = target_lm_head(target_model).float()
        if cfg.is_trimmed:
            if counts is None:
                raise ValueError("a trimmed draft vocabulary needs token counts")
            d2t, t2d = trimmed_vocab_from_counts(counts, cfg.draft_vocab_size)
            drafter.d2t.copy_(d2t)
            drafter.t2d.copy_(t2d)
            head = head[draft_to_target_ids(d2t)]
        drafter.lm_head.weight.copy_(head)
    return drafter
