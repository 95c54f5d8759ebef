"""Initialising a new EAGLE-3 drafter for a target (embeddings and head from the target, aux layers),
and growing an existing one by a hand-built induction head (:func:`add_induction_head`) or by a
decoder layer that starts as the identity (:func:`add_decoder_layer`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slimspec_convert.model.config import DrafterConfig, default_aux_boundaries
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.vocab import draft_to_target_ids, trimmed_vocab_from_counts
from slimspec_convert.targets.load import num_target_layers, target_embeddings, target_lm_head


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

    The embedding table is the target's own rows, unscaled: a target that scales its embedding
    (Gemma: ``sqrt(d)``) gives the drafter the same direction, and the first layer's RMSNorm on the
    embedding removes the scale anyway.

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
            drafter.norm.weight.copy_(norm_scale(target_norm, d))  # logit lens uses the target's final norm
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


@torch.no_grad()
def standardise_aux_input(drafter: Eagle3Drafter, aux: Tensor, mask: Tensor | None = None) -> Eagle3Drafter:
    """Scale a new drafter's residual stream to unit size, channel by channel, keeping its logit lens.

    :func:`new_drafter_for_target` starts ``fc`` as ``[0 | 0 | I]``: the residual stream is the target's
    highest aux state as it is. Targets with massive activations put most of that state's size in a
    few channels (Gemma 3 270M, layer 15: one channel's mean ``|x|`` near 19,000 against a median
    channel near 100), so every RMSNorm after ``fc`` squashes the other channels, and the decoder
    layer's outputs (zero at first, weights of std 0.02) need thousands of optimizer steps to weigh
    anything beside that stream. Here ``fc``'s block becomes ``diag(1 / sigma)`` (``sigma_c``: the RMS of
    channel ``c`` over ``aux``), every channel starts near unit size, and the final norm's gain is
    multiplied by ``sigma`` (times the mean ratio of the two streams' RMS), so the untrained drafter's
    logits are still the logit lens of that aux state, each token's scaled by a positive factor (the
    same argmax).

    Args:
        drafter: a drafter from :func:`new_drafter_for_target` (``fc`` = ``[0 | 0 | I]``), changed in place.
        aux: [..., K*d] float aux hidden states of the target on training text (the drafter's ``fc`` input).
        mask: [...] bool, the positions of ``aux`` to use (None: all).

    Returns:
        ``drafter``.

    Raises:
        ValueError: ``aux`` not ``K*d`` wide, or no position selected.
    """
    d = drafter.config.hidden_size
    width = drafter.fc.weight.shape[1]
    if aux.shape[-1] != width:
        raise ValueError(f"standardise_aux_input: aux is {aux.shape[-1]} wide, fc reads {width}")
    a = (aux[mask] if mask is not None else aux.reshape(-1, width))[:, width - d :].float()
    if a.shape[0] == 0:
        raise ValueError("standardise_aux_input: no position to measure the aux state on")
    sigma = a.pow(2).mean(0).sqrt().clamp_min(1e-6)  # [d]
    rms = a.pow(2).mean(-1).sqrt().clamp_min(1e-12)
    ratio = float(((a / sigma).pow(2).mean(-1).sqrt() / rms).mean())
    w = drafter.fc.weight
    w[:, width - d :] = torch.diag(1.0 / sigma).to(w.dtype)
    drafter.norm.weight.mul_((sigma * ratio).to(drafter.norm.weight.dtype))
    return drafter


@torch.no_grad()
def norm_scale(norm: nn.Module, d: int) -> Tensor:
    """The per-channel gain an RMSNorm applies, whatever its parametrisation: ``w`` (Llama) or
    ``1 + w`` (Gemma), read off its output on a unit-RMS input.

    Args:
        norm: an RMSNorm module over ``d`` channels.
        d: its width.

    Returns:
        [d] float32 gain ``g`` with ``norm(x) = x / rms(x) * g`` (up to eps).
    """
    w = next(norm.parameters())
    x = torch.ones(1, d, dtype=w.dtype, device=w.device)  # rms 1: norm(x) = g / sqrt(1 + eps)
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 0.0)))
    return (norm(x)[0].float() * (1.0 + eps) ** 0.5).cpu()


def _unit_rms(x: Tensor) -> Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)


@torch.no_grad()
def fit_token_probe(
    drafter: Eagle3Drafter, aux_hidden: Tensor, input_ids: Tensor, mask: Tensor, ridge: float = 1e-2
) -> tuple[Tensor, float]:
    """Least-squares map from the drafter's normed feature at position j to the token read there.

    ``b_j = midlayer.hidden_norm(fuse(aux_j))`` is what the decoder layer's key projection sees of
    the target at j; the probe ``M`` maps it to the unit-rms embedding of ``x_j`` (ridge regression).

    Args:
        drafter: the drafter whose ``fc`` and ``hidden_norm`` define ``b``.
        aux_hidden: [N, T, K*dt] the target's aux hidden states (float or bfloat16).
        input_ids: [N, T] int64 the tokens the target read (``x_j`` at position j).
        mask: [N, T] bool, True at real (non-padding) positions.
        ridge: ridge strength, as a fraction of the number of positions.

    Returns:
        (M [d, d] float32, top-1 share: how often the nearest embedding to ``M b_j`` is ``x_j``).

    Raises:
        ValueError: no real position.
    """
    if not bool(mask.any()):
        raise ValueError("fit_token_probe: no real position in mask")
    b = drafter.midlayer.hidden_norm(drafter.fuse(aux_hidden.float()))[mask].float()  # [P, d]
    ids = input_ids[mask]
    E = _unit_rms(drafter.embed_tokens.weight.float())  # [V, d]
    target = E[ids]
    gram = b.T @ b + ridge * b.shape[0] * torch.eye(b.shape[1])
    M = torch.linalg.solve(gram, b.T @ target).T
    nearest = (F.normalize(b @ M.T, dim=-1) @ F.normalize(E, dim=-1).T).argmax(-1)
    return M, float((nearest == ids).float().mean())


@torch.no_grad()
def add_induction_head(
    drafter: Eagle3Drafter,
    probe: Tensor,
    *,
    scale: float = 1.0,
    alpha: float = 5.0,
    num_pairs: int = 20,
    seed: int = 0,
    num_groups: int = 1,
) -> Eagle3Drafter:
    """A copy of ``drafter`` with ``num_groups`` more KV heads (and their query heads) built as
    induction heads.

    EAGLE-3's first layer reads ``[input_layernorm(e(x_{t+1})); hidden_norm(g_t)]`` at position t
    and predicts ``x_{t+2}``. When ``x_{t+1}`` occurred before, at position j, the token after it,
    ``x_{j+1}``, is a good guess (prompt lookup's unigram rule; Olsson et al. 2022, "In-context
    learning and induction heads"). One attention head can do that lookup here because EAGLE-3
    already shifts the embedding by one (the embedding half at j is ``x_{j+1}``):

    * query at t: ``scale * sqrt(hd) * P e^(x_{t+1})`` (embedding half);
    * key at j: ``P M b_j``, where ``M`` (:func:`fit_token_probe`) reads ``x_j`` off the feature;
    * value at j: ``Pv e^(x_{j+1})`` (embedding half);
    * output: ``alpha * diag(1 / w_norm) A Pv^T v``, which raises the logit of ``x_{j+1}`` (``A``
      maps embedding directions to head rows by least squares: the identity for a head tied to the
      embedding, as SmolLM2's).

    ``e^`` is the unit-rms embedding, ``P`` [2 * num_pairs, d] random orthonormal rows placed in the
    ``num_pairs`` lowest-frequency RoPE pairs (their rotation over a few hundred tokens is small, so
    the match does not depend on distance; each group draws its own), ``Pv`` [hd, d] the top
    principal directions of the embeddings. The other query heads of each new group start at zero
    (uniform attention, zero output columns); fine-tuning trains all of it. The layout stays a plain
    EAGLE-3 Llama layer (``num_attention_heads`` and ``num_key_value_heads`` grow by whole groups),
    so any EAGLE-3 runtime loads it.

    Args:
        drafter: the source drafter (not modified).
        probe: [d, d] from :func:`fit_token_probe` on this drafter.
        scale: query scale (attention sharpness).
        alpha: output scale; 0 leaves the drafter's function unchanged.
        num_pairs: RoPE pairs used for matching (at most head_dim / 2).
        seed: seed of ``P``.
        num_groups: KV groups added, each an induction head (their outputs add up).

    Returns:
        A new float32 drafter in eval mode.

    Raises:
        ValueError: ``num_pairs`` or ``num_groups`` out of range, a drafter whose query heads do not
            divide into its KV heads, a grown head count that does not divide ``hidden_size``
            (transformers' ``LlamaConfig`` requires it; SmolLM2's 576 takes 1 or 3 groups of 3), or
            a low-rank head (grow the dense drafter, then convert).
    """
    cfg = drafter.config
    d, hd = cfg.hidden_size, cfg.resolved_head_dim
    if not 0 < num_pairs <= hd // 2:
        raise ValueError(f"add_induction_head: num_pairs {num_pairs} not in 1..{hd // 2} (head_dim {hd})")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError("add_induction_head: query heads must divide into KV heads")
    if cfg.head_rank is not None:
        raise ValueError("add_induction_head: needs the dense head; grow the drafter before converting it")
    if num_groups < 1:
        raise ValueError(f"add_induction_head: num_groups {num_groups} < 1")
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    heads = cfg.num_attention_heads + group * num_groups
    if d % heads:
        raise ValueError(
            f"add_induction_head: hidden size {d} is not a multiple of {heads} attention heads "
            f"({cfg.num_attention_heads} + {num_groups} x {group}); transformers' LlamaConfig requires it"
        )
    wide = Eagle3Drafter(
        cfg.replace(num_attention_heads=heads, num_key_value_heads=cfg.num_key_value_heads + num_groups)
    ).float()
    old, new = drafter.state_dict(), wide.state_dict()
    for key, value in new.items():
        src = old[key].float() if old[key].is_floating_point() else old[key]
        if src.shape == value.shape:
            new[key] = src.clone()
        else:  # the attention projections grow: old rows (or o_proj columns) kept, new ones zero
            grown = torch.zeros_like(value)
            if key.endswith("o_proj.weight"):
                grown[:, : src.shape[1]] = src
            else:
                grown[: src.shape[0]] = src
            new[key] = grown
    wide.load_state_dict(new)
    gen = torch.Generator().manual_seed(seed)
    E = _unit_rms(wide.embed_tokens.weight.float())
    sample = (E - E.mean(0))[torch.randperm(E.shape[0], generator=gen)[: min(E.shape[0], 16384)]]
    Vh = torch.linalg.svd(sample, full_matrices=False)[2]  # principal directions of the embeddings
    Pv = Vh[:hd]  # [hd, d]
    low = list(range(hd // 2 - num_pairs, hd // 2))
    slots = torch.tensor(low + [i + hd // 2 for i in low])  # rotate_half pairs i with i + hd/2
    attn = wide.midlayer.self_attn
    w_in = wide.midlayer.input_layernorm.weight.float()
    w_out = getattr(wide.norm, "weight", None)  # None when the drafter has no final norm
    # embedding direction -> head direction: least squares over the head's rows (identity for a
    # head tied to the embedding, as SmolLM2's and the demo drafter's)
    head = _unit_rms(wide.lm_head.weight.float())  # [V_d, d]
    rows = E if wide.d2t is None else E[draft_to_target_ids(wide.d2t)]
    to_head = torch.linalg.lstsq(rows, head).solution.T  # [d, d]: head_y ~ to_head @ e^_y
    out = to_head @ Pv.T  # [d, hd]
    if w_out is not None:
        out = out / w_out.float()[:, None]
    for g in range(num_groups):
        P = torch.linalg.qr(torch.randn(d, 2 * num_pairs, generator=gen))[0].T  # [2 * num_pairs, d]
        q0 = (cfg.num_attention_heads + g * group) * hd
        k0 = (cfg.num_key_value_heads + g) * hd
        attn.q_proj.weight[q0 + slots, :d] = scale * hd**0.5 * P / w_in
        attn.k_proj.weight[k0 + slots, d:] = P @ probe.float()
        attn.v_proj.weight[k0 : k0 + hd, :d] = Pv / w_in
        attn.o_proj.weight[:, q0 : q0 + hd] = alpha * out
    return wide.eval()


@torch.no_grad()
def add_decoder_layer(drafter: Eagle3Drafter, *, std: float = 0.02, seed: int = 0) -> Eagle3Drafter:
    """A copy of ``drafter`` with one more decoder layer on top, which starts as the identity.

    The new layer is a plain pre-norm Llama block (``extra_layers.{i-1}.*``, the layout vLLM's and
    speculators' multi-layer EAGLE-3 drafters use) of the drafter's own geometry: ``q/k/v_proj``,
    ``gate_proj`` and ``up_proj`` drawn from N(0, std^2), norms at 1, ``o_proj`` and ``down_proj``
    zero, so both residual branches add nothing and the grown drafter computes exactly what the
    source did (function-preserving growth; LLaMA Pro's block expansion, Wu et al. 2024, zeroes the
    same two projections). Fine-tuning then trains the new layer from there; the first step's
    gradient reaches ``o_proj`` and ``down_proj``, the rest follows.

    Args:
        drafter: the source drafter (not modified), dense or low-rank head, any number of layers.
        std: standard deviation of the new input projections.
        seed: seed of the new weights.

    Returns:
        A new float32 drafter in eval mode with ``num_hidden_layers`` one higher.
    """
    cfg = drafter.config
    grown = Eagle3Drafter(cfg.replace(num_hidden_layers=cfg.num_hidden_layers + 1)).float()
    new = grown.state_dict()
    for key, value in drafter.state_dict().items():
        new[key] = value.float().clone() if value.is_floating_point() else value.clone()
    gen = torch.Generator().manual_seed(seed)
    prefix = f"extra_layers.{cfg.num_hidden_layers - 1}."
    for key in [k for k in new if k.startswith(prefix)]:
        if key.endswith(("o_proj.weight", "down_proj.weight")) or key.endswith(".bias"):
            new[key] = torch.zeros_like(new[key])
        elif key.endswith("layernorm.weight"):
            new[key] = torch.ones_like(new[key])
        else:
            new[key] = torch.randn(new[key].shape, generator=gen) * std
    grown.load_state_dict(new)
    return grown.eval()
