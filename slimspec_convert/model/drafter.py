"""The EAGLE-3 drafter module: fc over aux hidden states, one decoder layer on [embedding; hidden],
final norm and a swappable head (dense, low-rank, or trimmed with ``d2t``).

The forward pass follows eagle3-formats.md section 5.2 (sources: SafeAILab EAGLE ``cnets.py``,
SGLang ``llama_eagle3.py``, vLLM ``llama_eagle3.py``, speculators ``core.py``). RMSNorm, rotary
embeddings and the MLP are transformers' Llama modules; attention is ours because its first layer
takes a 2d-wide input and must accept arbitrary (tree / training-time-test) masks over a KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from slimspec_convert.model.config import DrafterConfig
from slimspec_convert.model.head import DEFAULT_RERANK_CONTEXT, LowRankHead, head_rank, make_head
from slimspec_convert.model.kv_cache import DraftKVCache


def llama_config_for(cfg: DrafterConfig) -> LlamaConfig:
    """The transformers ``LlamaConfig`` describing the drafter's decoder layer (its own RoPE, P15)."""
    kwargs = dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.resolved_head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_act=cfg.hidden_act,
        mlp_bias=cfg.mlp_bias,
        attention_bias=cfg.attention_bias,
        vocab_size=cfg.vocab_size,
        num_hidden_layers=cfg.num_hidden_layers,
    )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        rope.setdefault("rope_type", rope.get("type", "default"))
    try:
        return LlamaConfig(**kwargs, rope_parameters=rope)  # transformers >= 5
    except TypeError:  # pragma: no cover - transformers 4.x spelling
        return LlamaConfig(**kwargs, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose input width may be 2d (layer 0) or d (extra layers).

    Args:
        cfg: drafter config.
        in_features: 2d for the first layer ([embedding; hidden]), d otherwise.
    """

    def __init__(self, cfg: DrafterConfig, in_features: int) -> None:
        super().__init__()
        hd = cfg.resolved_head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_features, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, cfg.hidden_size, bias=bias)

    def forward(
        self,
        x: Tensor,
        cos_sin: tuple[Tensor, Tensor],
        layer_idx: int,
        cache: DraftKVCache | None,
        attn_mask: Tensor | None,
    ) -> Tensor:
        """Attend from ``x`` [B, T, in] over cached positions plus these T; returns [B, T, d].

        ``attn_mask`` is bool [B or 1, 1, T, S_past + T] (True = may attend); None means causal
        over the whole cache.
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos_sin
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        past = 0
        if cache is not None:
            past = cache.length(layer_idx)
            k, v = cache.update(layer_idx, k, v)
        if attn_mask is None and past > 0:
            attn_mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)[None, None]
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(rep, dim=1)  # [B, H, S, hd]
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None and T > 1
        )  # [B, H, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class Eagle3FirstLayer(nn.Module):
    """EAGLE-3's first decoder layer: attention over ``[input_layernorm(emb); hidden_norm(g)]``.

    Residual: ``g`` (default) or ``hidden_norm(g)`` when ``norm_before_residual`` (speculators).
    """

    def __init__(self, cfg: DrafterConfig, llama_cfg: LlamaConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)  # on the incoming feature
        self.self_attn = Eagle3Attention(cfg, 2 * d)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(llama_cfg)

    def forward(self, emb: Tensor, hidden: Tensor, cos_sin, cache, attn_mask) -> Tensor:
        """emb, hidden: [B, T, d] -> [B, T, d] (pre-norm residual stream)."""
        normed_hidden = self.hidden_norm(hidden)
        u = torch.cat([self.input_layernorm(emb), normed_hidden], dim=-1)  # [B, T, 2d], embedding first
        residual = normed_hidden if self.norm_before_residual else hidden
        h = residual + self.self_attn(u, cos_sin, 0, cache, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3ExtraLayer(nn.Module):
    """A plain pre-norm Llama block (layers >= 1 of multi-layer drafts; vLLM / speculators)."""

    def __init__(self, cfg: DrafterConfig, llama_cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.layer_idx = layer_idx
        self.input_layernorm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, d)
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(llama_cfg)

    def forward(self, h: Tensor, cos_sin, cache, attn_mask) -> Tensor:
        """[B, T, d] -> [B, T, d]."""
        h = h + self.self_attn(self.input_layernorm(h), cos_sin, self.layer_idx, cache, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter with a swappable head.

    State-dict keys are the canonical SpecForge / EAGLE names (``fc.weight``, ``midlayer.*``,
    ``norm.weight``, ``lm_head.weight`` or ``lm_head.down.weight`` + ``lm_head.up.weight``,
    ``d2t``, ``t2d``, ``embed_tokens.weight``); extra layers are ``extra_layers.{i-1}.*``.

    Args:
        cfg: the normalised drafter config.

    Raises:
        ValueError: through :class:`DrafterConfig` validation.
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        k_dt = cfg.num_aux_hidden_states * cfg.resolved_target_hidden_size
        llama_cfg = llama_config_for(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.input_norm = LlamaRMSNorm(k_dt, eps=cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(
                LlamaRMSNorm(cfg.resolved_target_hidden_size, eps=cfg.rms_norm_eps)
                for _ in range(cfg.num_aux_hidden_states)
            )
            if cfg.fc_norm
            else None
        )
        self.fc = nn.Linear(k_dt, d, bias=cfg.fc_bias) if cfg.use_aux_hidden_state else None
        self.midlayer = Eagle3FirstLayer(cfg, llama_cfg)
        self.extra_layers = nn.ModuleList(
            Eagle3ExtraLayer(cfg, llama_cfg, i) for i in range(1, cfg.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps) if cfg.has_final_norm else nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(config=llama_cfg)
        self._inv_freq_fp32 = self.rotary_emb.inv_freq.detach().clone()  # survives .to(bf16)
        self.lm_head = make_head(d, cfg.draft_vocab_size, cfg.head_rank)
        if cfg.is_trimmed:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.d2t = None
            self.t2d = None

    def _apply(self, fn, recurse=True):
        # Keep RoPE frequencies in float32 whatever dtype the weights are cast to.
        out = super()._apply(fn, recurse)
        device = self.rotary_emb.inv_freq.device
        self._inv_freq_fp32 = self._inv_freq_fp32.to(device)
        self.rotary_emb.inv_freq = self._inv_freq_fp32.clone()
        return out

    # ---- the three stages of one draft step -------------------------------------------------
    def fuse(self, aux_hidden: Tensor) -> Tensor:
        """Fuse the target's concatenated aux hidden states (low, mid, high).

        Args:
            aux_hidden: [B, T, K*dt] in ascending target-layer order.

        Returns:
            [B, T, d].
        """
        if self.fc is None:
            return aux_hidden
        x = aux_hidden
        if self.input_norm is not None:
            x = self.input_norm(x)
        elif self.fc_norm is not None:
            chunks = x.chunk(len(self.fc_norm), dim=-1)
            x = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(x.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        position_ids: Tensor,
        cache: DraftKVCache | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """Run the decoder layer(s) on tokens and features.

        Args:
            input_ids: [B, T] int64 target-vocabulary ids (the token *after* each feature position).
            hidden: [B, T, d] fused target features or the drafter's own previous output.
            position_ids: [B, T] int64 RoPE positions.
            cache: drafter KV cache, appended in place.
            attn_mask: bool [B or 1, 1, T, S_past + T], True = may attend; None = causal.

        Returns:
            [B, T, d], the pre-norm residual stream ``h`` (feed :meth:`logits` and
            :meth:`next_hidden`).
        """
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        cos_sin = self.rotary_emb(hidden, position_ids)
        h = self.midlayer(emb, hidden, cos_sin, cache, attn_mask)
        for layer in self.extra_layers:
            h = layer(h, cos_sin, cache, attn_mask)
        return h

    def logits(self, h: Tensor) -> Tensor:
        """Draft-vocabulary logits ``lm_head(norm(h))``: [..., d] -> [..., V_d]."""
        return self.lm_head(self.norm(h))

    def next_hidden(self, h: Tensor) -> Tensor:
        """Feature for the next draft step: ``h`` (EAGLE-3) or ``norm(h)`` (EAGLE 3.1 post-norm)."""
        return self.norm(h) if self.config.norm_output_postnorm else h

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary indices to target ids (``i + d2t[i]``); identity when untrimmed."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def enable_rerank(self, k: int, context: int = DEFAULT_RERANK_CONTEXT) -> None:
        """Shortlist rerank of the low-rank head with this drafter's ``embed_tokens`` rows.

        ``context`` > 0 (default 512) also rescores up to that many distinct tokens already in each
        sequence (prompt and answer, the most recent; :class:`~slimspec_convert.model.head.LowRankHead`),
        which the speculative decoder passes each round; 0 rescores the top-k alone.

        Exact only for drafters whose dense lm_head was the embedding table (a tied head, kept
        frozen: speculators heads of tied targets, ``slimspec train-drafter --train body``, the
        SmolLM2 demo drafter): there the reranked top-k scores equal the original head's.
        ``slimspec convert`` records that in ``config.head_is_embedding``; any other head would be
        rescored with the wrong rows, so it is refused. ``k = 0`` turns the rerank off. Greedy and
        sampled outputs stay lossless either way (verification decides); only acceptance changes.

        Raises:
            ValueError: a dense head, a trimmed vocabulary (V_d < V), a head not converted from the
                embedding (``head_is_embedding`` False or unrecorded), k outside [0, V_d], or
                context < 0.
        """

        if not isinstance(self.lm_head, LowRankHead):
            raise ValueError("rerank needs a low-rank lm_head (convert the drafter first)")
        if self.config.is_trimmed:
            raise ValueError(
                f"rerank needs a full-vocabulary head (draft_vocab_size {self.config.draft_vocab_size} "
                f"< vocab_size {self.config.vocab_size}): it rescores with embed_tokens rows, one per "
                "target id; convert with --full-vocab --target T for a full-vocabulary low-rank head"
            )
        if self.config.head_is_embedding is not True:
            why = (
                "the dense head it was converted from is not the embedding table (head_is_embedding "
                "= false: an untied target head or a head trained on its own)"
                if self.config.head_is_embedding is False
                else "its config does not record that the dense head it was converted from was the "
                "embedding table (head_is_embedding unset: converted without the embedding at hand or "
                "by an older slimspec; reconvert with `slimspec convert SRC OUT --target T`)"
            )
            raise ValueError(
                f"rerank rescores with embed_tokens rows, but {why}; it serves only heads converted "
                "from a tied embedding (speculators heads of tied targets, train-drafter --train body, "
                "the SmolLM2 demo drafter)"
            )
        self.lm_head.set_rerank(k, self.embed_tokens, context)

    @property
    def head_is_lowrank(self) -> bool:
        """True when lm_head is a :class:`~slimspec_convert.model.head.LowRankHead`."""
        return self.config.head_rank is not None


def with_head(drafter: Eagle3Drafter, head: nn.Module) -> Eagle3Drafter:
    """A copy of ``drafter`` whose lm_head is ``head`` (dense ``nn.Linear`` or :class:`LowRankHead`).

    Every other tensor is copied and loaded strictly; the config's ``head_rank`` follows the head.

    Args:
        drafter: the source drafter (left unchanged).
        head: the new head, mapping [..., d] to [..., V_d] with the same V_d.

    Returns:
        A new drafter on the source's device, in its dtype, eval mode.

    Raises:
        RuntimeError: the head's shapes do not fit the drafter (strict load).
    """
    new = Eagle3Drafter(drafter.config.replace(head_rank=head_rank(head)))
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("lm_head.")}
    state.update({f"lm_head.{k}": v for k, v in head.state_dict().items()})
    new.load_state_dict(state, strict=True)
    ref = next(p for p in drafter.parameters() if p.is_floating_point())
    return new.to(device=ref.device, dtype=ref.dtype).eval()
