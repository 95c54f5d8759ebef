"""config.json of any EAGLE-3 dialect -> :class:`~slimspec_convert.model.config.DrafterConfig` (I/O layer).

The tensors present decide the optional modules (eagle3-formats.md section 11, step 3); the
config decides geometry, RoPE, aux ids and flags, and every default assumed is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimspec_convert.checkpoint.names import (
    EMBED_KEY,
    FC_BIAS_KEY,
    FC_KEY,
    FC_NORM_PREFIX,
    INPUT_NORM_KEY,
    LM_HEAD_DOWN_KEY,
    LM_HEAD_KEY,
    LM_HEAD_UP_KEY,
    NORM_KEY,
    SLIMSPEC_SECTION,
)
from slimspec_convert.checkpoint.weightfiles import CheckpointError
from slimspec_convert.model.config import (
    AUX_CONVENTION_BOUNDARY,
    AUX_CONVENTION_OUTPUT_OF,
    DEFAULT_RMS_NORM_EPS,
    DEFAULT_ROPE_THETA,
    DrafterConfig,
)

NORM_OUTPUT_SEMANTICS = ("auto", "specforge", "engine")


DEFAULT_NUM_AUX = 3  # low, middle, high target layers (eagle3-formats.md section 6)


_AUX_IDS = "eagle_aux_hidden_state_layer_ids"


SPECFORGE_NORM_OUTPUT = ("eagle", "specforge", "torchspec")  # trainers whose norm_output = "norm before head"


_SPECULATORS_TOP_LEVEL = (
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "eagle_aux_hidden_state_layer_ids",
)


@dataclass
class ConfigContext:
    """What the config readers share: the flat config, its file, the tensors present, the findings.

    ``tensors`` maps canonical keys to objects with ``.shape`` and ``.origin``
    (:class:`~slimspec_convert.checkpoint.canonical.CanonicalTensor`).
    """

    flat: dict[str, Any]
    fmt: str
    where: Path
    tensors: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)

    @property
    def eagle_config(self) -> dict[str, Any]:
        """The nested ``eagle_config`` object ({} when absent)."""
        return self.flat.get("eagle_config") or {}


@dataclass
class ConfigResult:
    """:func:`drafter_config`'s answer.

    Attributes:
        config: the normalised config.
        aux_declared: aux ids as written (None: absent).
        aux_convention: how they were read ("boundary" / "output_of_layer" / None).
        norm_output_semantics: "specforge" / "engine" / None (no norm_output field).
        head_missing: the file has no lm_head (to be borrowed from the target).
    """

    config: DrafterConfig
    aux_declared: list[int] | None
    aux_convention: str | None
    norm_output_semantics: str | None
    head_missing: bool


def flat_config(config: dict[str, Any], fmt: str, where: Path) -> dict[str, Any]:
    """One flat dict of drafter fields; speculators nests the layer config (eagle3-formats.md 3.3).

    Raises:
        CheckpointError: a speculators config without a Llama ``transformer_layer_config``.
    """
    if fmt != "speculators":
        return dict(config)
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{where}: speculators config without 'transformer_layer_config'")
    if layer.get("model_type", "llama") != "llama":
        raise CheckpointError(
            f"{where}: transformer_layer_config.model_type={layer['model_type']!r}; "
            "only Llama-type draft layers are supported"
        )
    return {**layer, **{k: config[k] for k in _SPECULATORS_TOP_LEVEL if k in config}}


def native_config(config: dict[str, Any], where: Path, keys: Any) -> DrafterConfig:
    """The :class:`DrafterConfig` stored in a SlimSpec folder's ``slimspec`` section.

    ``own_embeddings`` follows the tensors present (``keys``); a folder whose config says it ships
    its own ``embed_tokens`` but whose weights lack it is refused rather than given the target's table.

    Raises:
        CheckpointError: an invalid section, or ``own_embeddings`` without the table.
    """
    try:
        cfg = DrafterConfig.from_dict(config[SLIMSPEC_SECTION]["drafter_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: invalid '{SLIMSPEC_SECTION}.drafter_config' ({e})") from e
    if cfg.own_embeddings and EMBED_KEY not in keys:
        raise CheckpointError(
            f"{where}: '{SLIMSPEC_SECTION}.drafter_config.own_embeddings' is true but '{EMBED_KEY}' is not "
            "in the weights; the drafter's own table was lost (the target's would silently replace it)"
        )
    return cfg.replace(own_embeddings=EMBED_KEY in keys)


def _req_int(flat: dict[str, Any], name: str, where: Path) -> int:
    if name not in flat or flat[name] is None:
        raise CheckpointError(f"{where}: missing field '{name}' (needed to build the drafter)")
    value = flat[name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{where}: field '{name}'={value!r}, expected a positive integer")
    return value


def geometry(flat: dict[str, Any], where: Path) -> dict[str, int]:
    """Layer geometry; ``num_key_value_heads`` defaults to H and ``head_dim`` to d / H (HF rules, P16).

    Raises:
        CheckpointError: a missing or non-positive required field, or d / H not an integer
            without ``head_dim``.
    """
    d = _req_int(flat, "hidden_size", where)
    heads = _req_int(flat, "num_attention_heads", where)
    geo = {
        "hidden_size": d,
        "intermediate_size": _req_int(flat, "intermediate_size", where),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # HF LlamaConfig default
        "vocab_size": _req_int(flat, "vocab_size", where),
        "num_hidden_layers": 1,
        "head_dim": d // heads,
    }
    for name in ("num_key_value_heads", "num_hidden_layers", "head_dim"):
        if flat.get(name) is not None:
            geo[name] = _req_int(flat, name, where)
    if flat.get("head_dim") is None and d % heads:
        raise CheckpointError(
            f"{where}: no 'head_dim' and hidden_size={d} is not a multiple of num_attention_heads={heads}"
        )
    return geo


def _rope(ctx: ConfigContext) -> tuple[float, dict[str, Any] | None]:
    """The drafter's own RoPE (P15): rope_parameters (transformers 5) or rope_theta + rope_scaling."""
    flat = ctx.flat
    params = flat.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", flat.get("rope_theta", DEFAULT_ROPE_THETA)))
        extra = {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, extra if extra.get("rope_type", extra.get("type", "default")) != "default" else None
    if "rope_theta" not in flat:
        ctx.warnings.append(
            f"rope_theta absent: the drafter's RoPE uses theta={DEFAULT_ROPE_THETA} (the Llama default)"
        )
    scaling = flat.get("rope_scaling") or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(flat.get("rope_theta") or DEFAULT_ROPE_THETA), scaling


def _head(ctx: ConfigContext, d: int, vocab: int) -> tuple[int | None, int, bool]:
    """(rank or None, rows, missing) of the lm_head, from the tensors; config.json must agree."""
    t, flat = ctx.tensors, ctx.flat
    head_rank, missing = None, False
    if LM_HEAD_UP_KEY in t or LM_HEAD_DOWN_KEY in t:
        if LM_HEAD_UP_KEY not in t or LM_HEAD_DOWN_KEY not in t:
            absent = LM_HEAD_UP_KEY if LM_HEAD_UP_KEY not in t else LM_HEAD_DOWN_KEY
            raise CheckpointError(f"{ctx.where.parent}: low-rank head without '{absent}'")
        head_rank, rows = t[LM_HEAD_DOWN_KEY].shape[0], t[LM_HEAD_UP_KEY].shape[0]
        divisor = flat.get("lm_head_rank_divisor")
        if divisor and d // int(divisor) != head_rank:
            raise CheckpointError(
                f"{t[LM_HEAD_DOWN_KEY].origin} has rank {head_rank} but config "
                f"lm_head_rank_divisor={divisor} gives hidden_size // divisor = {d // int(divisor)}"
            )
    elif LM_HEAD_KEY in t:
        rows = t[LM_HEAD_KEY].shape[0]
    else:
        missing, rows = True, flat.get("draft_vocab_size") or vocab
        ctx.warnings.append("no lm_head in the file: engines share the target's head; it must be borrowed")
    declared = flat.get("draft_vocab_size", flat.get("truncated_vocab_size"))
    if declared is not None and declared != rows:
        origin = t[LM_HEAD_UP_KEY if head_rank else LM_HEAD_KEY].origin
        raise CheckpointError(
            f"{origin} has {rows} rows but config.json says draft_vocab_size={declared}; "
            "was the head trimmed or transposed?"
        )
    return head_rank, int(rows), missing


def _num_aux(ctx: ConfigContext, d: int) -> tuple[int, bool]:
    """(K, use_aux_hidden_state): K from fc's input width K * dt (P17), cross-checked with the config.

    A config without aux ids or ``num_aux_hidden_states`` implies the EAGLE-3 default K = 3 (the
    aux-layer resolver then captures three layers), so fc must take 3 * dt columns.
    """
    dt = ctx.flat.get("target_hidden_size") or d
    use_aux = bool(ctx.eagle_config.get("use_aux_hidden_state", True))
    num_aux = DEFAULT_NUM_AUX
    if FC_KEY in ctx.tensors:
        in_features = ctx.tensors[FC_KEY].shape[1]
        if in_features % dt:
            raise CheckpointError(
                f"{ctx.tensors[FC_KEY].origin} has {in_features} input columns, not a multiple of "
                f"target_hidden_size={dt}"
            )
        num_aux = in_features // dt
        declared = (
            ctx.flat.get(_AUX_IDS),
            ctx.eagle_config.get(_AUX_IDS),
            ctx.flat.get("num_aux_hidden_states"),
        )
        if num_aux != DEFAULT_NUM_AUX and all(x is None for x in declared):
            # K read off fc's own width alone would define the very shape fc is checked against
            raise CheckpointError(
                f"{ctx.tensors[FC_KEY].origin} has shape {list(ctx.tensors[FC_KEY].shape)}, expected "
                f"[{d}, {DEFAULT_NUM_AUX * dt}] from config.json: hidden_size={d}, {DEFAULT_NUM_AUX} aux "
                f"states of target_hidden_size={dt} (no aux layer ids or num_aux_hidden_states, so the "
                "EAGLE-3 default of 3 applies)"
            )
    elif use_aux:
        raise CheckpointError(
            f"{ctx.where.parent}: missing tensor '{FC_KEY}' (eagle_config.use_aux_hidden_state is not false)"
        )
    if ctx.flat.get("num_aux_hidden_states") not in (None, num_aux):
        raise CheckpointError(
            f"{ctx.where}: num_aux_hidden_states={ctx.flat['num_aux_hidden_states']} but '{FC_KEY}' takes "
            f"{num_aux} states of width {dt}"
        )
    return num_aux, use_aux


def _aux_ids(
    ctx: ConfigContext, num_aux: int, target_num_layers: int | None
) -> tuple[tuple[int, ...] | None, list[int] | None, str | None]:
    """(boundary ids, ids as declared, convention read) per eagle3-formats.md section 6."""
    top = ctx.flat.get("eagle_aux_hidden_state_layer_ids")
    nested = ctx.eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if top is not None:  # top level: vLLM / speculators, boundary convention
        boundaries = sorted(int(i) for i in top)
        if nested is not None and sorted(int(i) + 1 for i in nested) != boundaries:
            raise CheckpointError(
                f"{ctx.where}: top-level eagle_aux_hidden_state_layer_ids={list(top)} (boundaries) "
                f"disagree with eagle_config's {list(nested)} (output of layer, +1)"
            )
        declared, conv = list(top), AUX_CONVENTION_BOUNDARY
    elif nested is not None:  # nested: SpecForge / ModelOpt, output-of-layer convention
        declared, conv = list(nested), AUX_CONVENTION_OUTPUT_OF
        boundaries = sorted(int(i) + 1 for i in nested)
        if target_num_layers is not None and boundaries[-1] > target_num_layers:
            boundaries, conv = sorted(int(i) for i in nested), AUX_CONVENTION_BOUNDARY
            ctx.warnings.append(
                f"eagle_config ids {list(nested)} reach L={target_num_layers} only as boundaries "
                "(gpt-oss-120b-v3 style); read as boundaries"
            )
    else:
        return None, None, None
    if len(boundaries) != num_aux:
        raise CheckpointError(
            f"{ctx.where}: {len(boundaries)} aux layer ids {declared} but '{FC_KEY}' takes "
            f"{num_aux} hidden states"
        )
    return tuple(boundaries), declared, conv


def _norm_output(ctx: ConfigContext, semantics: str) -> tuple[bool, bool, str | None]:
    """(post-norm recurrence, final norm before the head, semantics used) from ``norm_output`` (P7)."""
    has_final = bool(ctx.eagle_config.get("use_last_layernorm", True))  # ModelOpt switch (P9)
    value = ctx.flat.get("norm_output", ctx.eagle_config.get("norm_output"))
    if value is None:
        return False, has_final, None
    if semantics == "auto":
        semantics = "specforge" if ctx.fmt in SPECFORGE_NORM_OUTPUT else "engine"
    if semantics == "engine":
        return bool(value), has_final, semantics
    # SpecForge <= 0.2.0: norm_output = apply the final norm before lm_head; recurrence always pre-norm.
    ctx.warnings.append(
        f"norm_output={value} read with SpecForge <= 0.2.0 semantics; pass "
        "norm_output_semantics='engine' for drafts trained after SpecForge PR #879"
    )
    if not value:
        if NORM_KEY in ctx.tensors:
            ctx.ignored[NORM_KEY] = "unused: SpecForge <= 0.2.0 norm_output=false feeds lm_head un-normed h"
        return False, False, semantics
    return False, has_final, semantics


def _flags(ctx: ConfigContext, semantics: str) -> tuple[dict[str, Any], str | None]:
    """Norm / residual / recurrence switches; optional tensors decide, disagreements are reported."""
    out: dict[str, Any] = {}
    for name, present in (
        ("norm_before_fc", INPUT_NORM_KEY in ctx.tensors),
        ("fc_norm", any(k.startswith(FC_NORM_PREFIX) for k in ctx.tensors)),
    ):
        declared = ctx.eagle_config.get(name, ctx.flat.get(name))
        if declared is not None and bool(declared) != present:
            ctx.warnings.append(
                f"config {name}={declared} but the tensors say {present}; following the tensors"
            )
        out[name] = present
    nbr = ctx.flat.get("norm_before_residual")
    if nbr is None:
        nbr = ctx.fmt == "speculators"  # vLLM assumes true for speculators configs without the field (P8)
        ctx.warnings.append(f"norm_before_residual absent: {nbr} ({ctx.fmt} default)")
    out["norm_before_residual"] = bool(nbr)
    postnorm, has_final, used = _norm_output(ctx, semantics)
    if not has_final and NORM_KEY in ctx.tensors and NORM_KEY not in ctx.ignored:
        raise CheckpointError(
            f"{ctx.tensors[NORM_KEY].origin} present but eagle_config.use_last_layernorm=false"
        )
    out.update(norm_output_postnorm=postnorm, has_final_norm=has_final)
    return out, used


def drafter_config(
    ctx: ConfigContext, geo: dict[str, int], target_num_layers: int | None, norm_output_semantics: str
) -> ConfigResult:
    """DrafterConfig from a flat config plus the tensors present.

    Args:
        ctx: flat config, its file, the canonical tensors, and the lists findings go to.
        geo: :func:`geometry` of the flat config.
        target_num_layers: L of the target when known (aux-id conventions).
        norm_output_semantics: "auto", "specforge" or "engine" (P7).

    Returns:
        :class:`ConfigResult`.

    Raises:
        CheckpointError: tied embeddings (P11), an unsupported variant, or config and tensors
            that disagree on the head rows, rank, fc width or aux ids.
    """
    if ctx.flat.get("tie_word_embeddings"):
        raise CheckpointError(
            f"{ctx.where}: tie_word_embeddings=true would make engines use the embedding as the head; "
            "set it to false in config.json if lm_head.weight is the trained head"
        )
    if ctx.eagle_config.get("use_input_layernorm_in_first_layer") is False:
        raise CheckpointError(
            f"{ctx.where}: eagle_config.use_input_layernorm_in_first_layer=false is not supported "
            "(the drafter always normalises the token embedding)"
        )
    d, flat = geo["hidden_size"], ctx.flat
    head_rank, rows, head_missing = _head(ctx, d, geo["vocab_size"])
    num_aux, use_aux = _num_aux(ctx, d)
    aux, declared, conv = _aux_ids(ctx, num_aux, target_num_layers)
    flags, semantics = _flags(ctx, norm_output_semantics)
    theta, scaling = _rope(ctx)
    if "rms_norm_eps" not in flat:
        ctx.warnings.append(f"rms_norm_eps absent: using {DEFAULT_RMS_NORM_EPS}")
    try:
        cfg = DrafterConfig(
            **geo | {"head_dim": flat.get("head_dim"), "draft_vocab_size": rows},
            target_hidden_size=flat.get("target_hidden_size"),
            num_aux_hidden_states=num_aux,
            aux_layer_ids=aux,
            aux_layer_ids_source=conv or AUX_CONVENTION_BOUNDARY,
            rms_norm_eps=float(flat.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(flat.get("max_position_embeddings", 2048)),
            hidden_act=flat.get("hidden_act", "silu"),
            attention_bias=bool(flat.get("attention_bias", False)),
            mlp_bias=bool(flat.get("mlp_bias", False)),
            fc_bias=FC_BIAS_KEY in ctx.tensors,
            use_aux_hidden_state=use_aux,
            head_rank=head_rank,
            own_embeddings=EMBED_KEY in ctx.tensors,
            source_format=ctx.fmt,
            **flags,
        )
    except ValueError as e:
        raise CheckpointError(f"{ctx.where}: {e}") from e
    return ConfigResult(cfg, declared, conv, semantics, head_missing)
