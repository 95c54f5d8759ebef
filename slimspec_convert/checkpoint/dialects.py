"""Detect the layout of a published EAGLE-3 drafter and map it onto SlimSpec's canonical names (I/O layer).

Five on-disk dialects (eagle3-formats.md sections 1-3 and 11), TorchSpec's low-rank variant and
SlimSpec's own folders:

===========  ==========================================================  ================================
format       recognised by                                               layer keys
===========  ==========================================================  ================================
eagle        SafeAILab EAGLE: flat config, ``LlamaForCausalLM``          ``midlayer.*``
specforge    SpecForge / SGLang: ``LlamaForCausalLMEagle3``              ``midlayer.*``
speculators  ``speculators_model_type: eagle3``, transformer_layer_config  ``layers.{i}.*``
modelopt     ``eagle_config`` with ModelOpt switches                     ``layers.{i}.*``, ``midlayer.{i}``
vllm         vLLM's renamed keys: ``model.`` prefix, fused qkv / gate_up ``model.layers.{i}.*``
torchspec    ``lm_head_rank_divisor`` / ``lm_head.down.weight`` (PR #185) ``midlayer.*``
slimspec     a ``slimspec`` section in config.json                       canonical
===========  ==========================================================  ================================

Canonical names are :class:`~slimspec_convert.model.drafter.Eagle3Drafter`'s state-dict keys:
``midlayer.*`` for the first layer, ``extra_layers.{i-1}.*`` for layer i >= 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slimspec_convert.checkpoint.canonical import CanonicalTensor, LoadReport, ResolvedCheckpoint
from slimspec_convert.checkpoint.dialect_config import (
    ConfigContext,
    ConfigResult,
    drafter_config,
    flat_config,
    geometry,
    native_config,
)
from slimspec_convert.checkpoint.folders import open_weights, read_config
from slimspec_convert.checkpoint.names import (
    CONFIG_NAME,
    D2T_KEY,
    EMBED_KEY,
    EXTRA_LAYER_PREFIX,
    FC_KEY,
    FIRST_LAYER_PREFIX,
    HEAD_FROM_TARGET,
    LAYER_KEY_RE,
    LAYERS_PREFIX,
    LM_HEAD_DOWN_KEY,
    LM_HEAD_KEY,
    MIDLAYER_PREFIX,
    MODEL_PREFIX,
    SLIMSPEC_SECTION,
    T2D_KEY,
    VLLM_D2T_KEY,
    VLLM_FUSED,
)
from slimspec_convert.checkpoint.weightfiles import CheckpointError, TensorRef
from slimspec_convert.lowrank.blocks import count_nonfinite
from slimspec_convert.model.config import DrafterConfig
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.vocab import VocabMapError, t2d_from_d2t, validate_vocab_maps
from slimspec_convert.targets.load import drafter_evidence

FORMATS = ("slimspec", "eagle", "specforge", "speculators", "modelopt", "vllm", "torchspec")


_SPECFORGE_NORM_OUTPUT = (
    "eagle",
    "specforge",
    "torchspec",
)  # trainers whose norm_output = "norm before head"


_MODELOPT_KEYS = (
    "use_last_layernorm",
    "use_input_layernorm_in_first_layer",
    "use_mtp_layernorm",
    "parallel_draft_step",
    "next_layer_regular",
)


_HINTS = (  # unexpected key fragment -> what it means
    ("_scale", "a quantised export: dequantise it first"),
    ("parallel_draft_heads", "ModelOpt parallel draft heads (parallel_draft_step > 1) are not supported"),
    ("q_norm", "Qwen3-type draft layers (q/k norms) are not supported"),
    ("k_norm", "Qwen3-type draft layers (q/k norms) are not supported"),
)


def detect_format(config: dict[str, Any], keys: list[str]) -> tuple[str, list[str]]:
    """Which dialect a checkpoint is, from config.json and its tensor names (no flag needed).

    Args:
        config: parsed config.json.
        keys: tensor names in the weight files.

    Returns:
        (format, evidence strings).

    Raises:
        CheckpointError: when nothing identifies an EAGLE-3 drafter.
    """
    arch = (config.get("architectures") or [""])[0]
    eagle_config = config.get("eagle_config") or {}
    stripped = [_strip_model(k) for k in keys]
    if SLIMSPEC_SECTION in config:
        return "slimspec", [f"config.json has a '{SLIMSPEC_SECTION}' section"]
    if config.get("speculators_model_type") == "eagle3":
        return "speculators", ["config.json speculators_model_type == 'eagle3'"]
    fused = tuple(f".{name}." for name in VLLM_FUSED)
    if any(k.startswith(MODEL_PREFIX + LAYERS_PREFIX) for k in keys) or any(
        any(f in k for f in fused) or k == VLLM_D2T_KEY for k in stripped
    ):
        return "vllm", ["model.layers.N / fused qkv_proj, gate_up_proj / draft_id_to_target_id (vLLM names)"]
    if any(k in eagle_config for k in _MODELOPT_KEYS):
        found = [k for k in _MODELOPT_KEYS if k in eagle_config]
        return "modelopt", [f"eagle_config has ModelOpt switches {found}"]
    if "lm_head_rank_divisor" in config or LM_HEAD_DOWN_KEY in stripped:
        return "torchspec", [
            "config lm_head_rank_divisor / lm_head.down.weight (TorchSpec PR #185 low-rank head)"
        ]
    if "eagle3" in arch.lower():
        if any(k.startswith(LAYERS_PREFIX) for k in stripped):
            return "modelopt", [f"architectures[0] == {arch!r} with layers.N keys (ModelOpt export)"]
        return "specforge", [f"architectures[0] == {arch!r} with midlayer keys"]
    has_draft_vocab = "draft_vocab_size" in config or "truncated_vocab_size" in config
    midlayer = any(k.startswith(MIDLAYER_PREFIX) for k in stripped)
    if midlayer and (has_draft_vocab or arch == "LlamaForCausalLM"):
        return "eagle", [f"architectures[0] == {arch!r} with midlayer keys (SafeAILab EAGLE template)"]
    raise CheckpointError(
        f"config.json: architectures={config.get('architectures')!r} and tensor names "
        f"{sorted(keys)[:6]}... do not match any known EAGLE-3 drafter layout "
        "(eagle, specforge, speculators, modelopt, vllm, torchspec, slimspec)"
    )


def _not_a_target(path: Path, config: dict[str, Any], refs: dict[str, TensorRef]) -> None:
    """Refuse a target model where a drafter is expected: no drafter config field and no ``fc.weight``.

    Raises:
        CheckpointError: naming both roles.
    """
    if SLIMSPEC_SECTION in config or drafter_evidence(config) is not None:
        return
    if any(_strip_model(k) == FC_KEY for k in refs):
        return
    raise CheckpointError(
        f"{path}: a target model (architectures={config.get('architectures')}, no '{FC_KEY}' and no "
        "drafter field in config.json), not an EAGLE-3 drafter; pass it as --target and the drafter as "
        "--drafter / SRC"
    )


def _strip_model(key: str) -> str:
    while key.startswith(MODEL_PREFIX):  # NeMo / vLLM prefixes (eagle3-formats.md P2)
        key = key[len(MODEL_PREFIX) :]
    return key


def _canonical_layer_key(layer: int, rest: str) -> str:
    return f"{FIRST_LAYER_PREFIX}{rest}" if layer == 0 else f"{EXTRA_LAYER_PREFIX}{layer - 1}.{rest}"


def _map_keys(
    refs: dict[str, TensorRef], fmt: str, q_rows: int, kv_rows: int, inter: int
) -> dict[str, CanonicalTensor]:
    """File keys -> canonical keys (prefixes, layer numbering, vLLM fused tensors and d2t name)."""
    out: dict[str, CanonicalTensor] = {}

    def put(key: str, ct: CanonicalTensor) -> None:
        if key in out:
            raise CheckpointError(
                f"{ct.ref.file}: tensors '{ct.ref.key}' and '{out[key].ref.key}' both map to '{key}'"
            )
        out[key] = ct

    for file_key, ref in refs.items():
        key = file_key if fmt == "slimspec" else _strip_model(file_key)
        if key == VLLM_D2T_KEY:
            key = D2T_KEY
        m = LAYER_KEY_RE.match(key) if fmt != "slimspec" else None
        if m is None:
            put(key, CanonicalTensor(key, ref, origin=ref.where))
            continue
        layer = int(m.group(1) or m.group(2) or 0)
        rest = m.group(3)
        module, _, param = rest.rpartition(".")
        if module in VLLM_FUSED:
            sizes = (q_rows, kv_rows, kv_rows) if len(VLLM_FUSED[module]) == 3 else (inter, inter)
            if ref.shape[0] != sum(sizes):
                raise CheckpointError(
                    f"{ref.where} has {ref.shape[0]} rows, expected {' + '.join(map(str, sizes))} from "
                    "num_attention_heads / num_key_value_heads / head_dim / intermediate_size in config.json"
                )
            start = 0
            for part, size in zip(VLLM_FUSED[module], sizes, strict=True):
                ck = _canonical_layer_key(layer, f"{part}.{param}")
                put(
                    ck,
                    CanonicalTensor(
                        ck,
                        ref,
                        rows=(start, start + size),
                        origin=f"{ref.where} rows [{start}:{start + size}]",
                    ),
                )
                start += size
            continue
        ck = _canonical_layer_key(layer, rest)
        put(ck, CanonicalTensor(ck, ref, origin=ref.where))
    return out


def resolve_checkpoint(
    path: str | Path, *, target_num_layers: int | None = None, norm_output_semantics: str = "auto"
) -> ResolvedCheckpoint:
    """Read config.json and the weight-file headers of a drafter and map them onto canonical names.

    Headers and the small ``d2t`` / ``t2d`` tensors are read, then every float tensor once in row
    blocks (memory-mapped) to refuse NaN/inf wherever it is. Every canonical tensor
    is accounted for: from the file (with its file and key), rebuilt (``t2d`` from ``d2t`` for
    ModelOpt), or missing (``embed_tokens`` and a head-less ModelOpt/SGLang drafter's ``lm_head``,
    which the caller borrows from the target).

    Args:
        path: checkpoint folder.
        target_num_layers: L of the target when known; decides ids that only make sense as
            boundaries (gpt-oss-120b-v3 style lists ending at L).
        norm_output_semantics: "auto", "specforge" (<= 0.2.0: ``norm_output`` = final norm before
            lm_head, recurrence pre-norm) or "engine" (vLLM / SGLang / speculators: ``norm_output``
            = post-norm recurrence, EAGLE 3.1). "auto" picks specforge for EAGLE, SpecForge and
            TorchSpec configs and engine otherwise (eagle3-formats.md P7).

    Returns:
        :class:`ResolvedCheckpoint`.

    Raises:
        CheckpointError: unknown layout, missing config field, unexpected / missing / mis-shaped
            tensor, inconsistent vocab maps, unsupported variant, NaN/inf in any float tensor; the
            message names file and field.
        FileNotFoundError: the folder does not exist.
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such checkpoint folder")
    config = read_config(p)
    refs, files = open_weights(p)
    _not_a_target(p, config, refs)
    fmt, evidence = detect_format(config, list(refs))
    where = p / CONFIG_NAME
    if config.get("quantization_config") or any(k.endswith("_scale") for k in refs):
        raise CheckpointError(
            f"{where}: a quantised export (quantization_config / *_scale tensors); "
            "dequantise it before converting"
        )
    if fmt == "slimspec":
        ctx = ConfigContext(config, fmt, where, _map_keys(refs, fmt, 0, 0, 0))
        cfg = native_config(config, where, ctx.tensors)
        result = ConfigResult(
            cfg,
            list(cfg.aux_layer_ids or []) or None,
            cfg.aux_layer_ids_source,
            None,
            _native_head_from_target(config, where, ctx.tensors, cfg),
        )
    else:
        flat = flat_config(config, fmt, where)
        geo = geometry(flat, where)
        hd = geo["head_dim"]
        tensors = _map_keys(
            refs,
            fmt,
            geo["num_attention_heads"] * hd,
            geo["num_key_value_heads"] * hd,
            geo["intermediate_size"],
        )
        ctx = ConfigContext(flat, fmt, where, tensors)
        result = drafter_config(ctx, geo, target_num_layers, norm_output_semantics)
        for k in ctx.ignored:
            tensors.pop(k, None)
    cfg = result.config
    rebuilt = _vocab(cfg, ctx.tensors, files, ctx.warnings, ctx.ignored)
    ordered = _validate(cfg, ctx.tensors, files, result.head_missing)
    check_finite(ordered.values())
    report = LoadReport(
        path=str(p),
        source_format=fmt,
        evidence=evidence,
        files=[str(f) for f in files],
        file_bytes=sum(f.stat().st_size for f in files),
        config=cfg,
        tensors={k: ct.origin for k, ct in ordered.items()},
        rebuilt=rebuilt,
        ignored=ctx.ignored,
        aux_layer_ids_declared=result.aux_declared,
        aux_layer_ids_convention=result.aux_convention if result.aux_declared is not None else None,
        norm_output_semantics=result.norm_output_semantics,
        warnings=ctx.warnings,
    )
    for ct in ordered.values():
        if ct.dtype.is_floating_point:
            name = str(ct.dtype).removeprefix("torch.")
            report.dtypes[name] = report.dtypes.get(name, 0) + 1
            if ct.key != EMBED_KEY:
                report.num_params += int(torch.Size(ct.shape).numel())
    return ResolvedCheckpoint(cfg, ordered, report, result.head_missing)


def _vocab(
    cfg: DrafterConfig,
    tensors: dict[str, CanonicalTensor],
    files: list[Path],
    warnings: list[str],
    ignored: dict[str, str],
) -> list[str]:
    """Check d2t / t2d (P4, P5); rebuild a missing t2d; drop identity maps of untrimmed heads."""
    d2t_ct, t2d_ct = tensors.get(D2T_KEY), tensors.get(T2D_KEY)
    where = str(d2t_ct.ref.file if d2t_ct else files[0])
    d2t = d2t_ct.load() if d2t_ct is not None else None
    t2d = t2d_ct.load() if t2d_ct is not None else None
    if not cfg.is_trimmed and (d2t is not None or t2d is not None):
        identity = (d2t is None or (d2t.numel() == cfg.draft_vocab_size and not bool(d2t.any()))) and (
            t2d is None or (t2d.numel() == cfg.vocab_size and bool(t2d.all()))
        )
        if not identity:
            raise CheckpointError(
                f"{where}: '{D2T_KEY}'/'{T2D_KEY}' are not the identity but the head has all "
                f"vocab_size={cfg.vocab_size} rows; a permuted full head is not supported"
            )
        for ct in (d2t_ct, t2d_ct):
            if ct is not None:
                tensors.pop(ct.key)
                ignored[ct.ref.key] = "identity map of a full-vocabulary head"
        return []
    try:
        validate_vocab_maps(d2t, t2d, cfg.draft_vocab_size, cfg.vocab_size, where=where)
    except VocabMapError as e:
        raise CheckpointError(str(e)) from e
    if cfg.is_trimmed and t2d is None:
        tensors[T2D_KEY] = CanonicalTensor(
            T2D_KEY,
            value=t2d_from_d2t(d2t.to(torch.int64), cfg.vocab_size),
            origin="rebuilt from d2t (the file has no t2d)",
        )
        warnings.append("no t2d in the file (ModelOpt and vLLM ship none): rebuilt from d2t")
        return [T2D_KEY]
    return []


def check_finite(tensors) -> None:
    """Refuse NaN/inf in any float tensor (each read once in row blocks, no full-size copy).

    Args:
        tensors: :class:`CanonicalTensor` objects.

    Raises:
        CheckpointError: ``{file}: '{key}' has N NaN/inf entries``.
    """
    for ct in tensors:
        if ct.dtype.is_floating_point and (bad := count_nonfinite(ct.view())):
            raise CheckpointError(f"{ct.origin} has {bad} NaN/inf entries; the checkpoint is corrupt")


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Canonical key -> (shape, dtype) of :class:`Eagle3Drafter` for ``cfg`` (built on the meta device)."""
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    return {
        k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")
    }


def _native_head_from_target(
    config: dict, where: Path, tensors: dict[str, CanonicalTensor], cfg: DrafterConfig
) -> bool:
    """Whether a SlimSpec folder's lm_head is the target's (``slimspec.lm_head_from_target``).

    Raises:
        CheckpointError: the flag on a low-rank head, or with an ``lm_head.weight`` in the weights.
    """
    if not config[SLIMSPEC_SECTION].get(HEAD_FROM_TARGET):
        return False
    if cfg.head_rank is not None or LM_HEAD_KEY in tensors:
        raise CheckpointError(
            f"{where}: '{SLIMSPEC_SECTION}.{HEAD_FROM_TARGET}' is true, but the weights hold a head "
            f"({'rank ' + str(cfg.head_rank) if cfg.head_rank is not None else LM_HEAD_KEY}); "
            "drop the flag or the tensor"
        )
    return True


def _validate(
    cfg: DrafterConfig, tensors: dict[str, CanonicalTensor], files: list[Path], head_missing: bool
) -> dict[str, CanonicalTensor]:
    """Strict key and shape check against the module; returns the tensors in state-dict order."""
    expected = expected_shapes(cfg)
    allowed_missing = {EMBED_KEY} | ({LM_HEAD_KEY} if head_missing else set())
    missing = sorted(set(expected) - set(tensors) - allowed_missing)
    unexpected = sorted(set(tensors) - set(expected))
    names = ", ".join(str(f) for f in files)
    if unexpected:
        hints = sorted({h for k in unexpected for frag, h in _HINTS if frag in k})
        origins = [tensors[k].origin for k in unexpected]
        raise CheckpointError(
            f"{names}: unexpected tensors {origins}" + (f" ({'; '.join(hints)})" if hints else "")
        )
    if missing:
        raise CheckpointError(
            f"{names}: missing tensors {missing} for the architecture config.json describes"
        )
    for k, ct in tensors.items():
        shape, dtype = expected[k]
        if ct.shape != shape:
            raise CheckpointError(
                f"{ct.origin} has shape {list(ct.shape)}, expected {list(shape)} from config.json"
            )
        if dtype.is_floating_point != ct.dtype.is_floating_point or (dtype == torch.bool) != (
            ct.dtype == torch.bool
        ):
            raise CheckpointError(f"{ct.origin} has dtype {ct.dtype}, expected a {dtype}-like tensor")
    return {k: tensors[k] for k in expected if k in tensors}
