"""Write one drafter's weights in each published EAGLE-3 on-disk layout (test helper, no tests here).

Key names and config fields follow eagle3-formats.md sections 1-3 (sources cited there):
SafeAILab EAGLE ``traineagle3`` template (pytorch_model.bin), SpecForge ``configs/*-eagle3.json``,
speculators ``Eagle3SpeculatorConfig``, ModelOpt ``hf_spec_export.py`` (layers.N, no t2d),
vLLM ``llama_eagle3.py`` in-memory names, TorchSpec PR #185 low-rank head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from slimspec_convert.model.drafter import Eagle3Drafter

LAYOUTS = ("eagle", "specforge", "specforge_sharded", "speculators", "modelopt", "vllm")


def canonical_state(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The drafter's state dict without RoPE buffers, tensors cloned and contiguous."""
    return {
        k: v.detach().clone().contiguous()
        for k, v in drafter.state_dict().items()
        if not k.startswith("rotary_emb.")
    }


def _flat_config(drafter: Eagle3Drafter, architectures: list[str]) -> dict:
    c = drafter.config
    out = {
        "architectures": architectures,
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": c.num_hidden_layers,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",  # templates say float16 whatever the tensors are (P14)
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if c.rope_theta != 10000.0:
        out["rope_theta"] = c.rope_theta
    if c.rope_scaling:
        out["rope_scaling"] = c.rope_scaling
    if c.head_dim is not None:
        out["head_dim"] = c.head_dim
    if c.target_hidden_size is not None:
        out["target_hidden_size"] = c.target_hidden_size
    for flag in (
        "norm_before_residual",
        "norm_before_fc",
        "fc_norm",
    ):  # written only when set, as trainers do
        if getattr(c, flag):
            out[flag] = True
    return out


def _layer_renamed(state: dict, first: str, extra: str) -> dict:
    """midlayer.* -> first; extra_layers.{j}.* -> extra.format(i=j + 1)."""
    out = {}
    for k, v in state.items():
        if k.startswith("midlayer."):
            out[first + k[len("midlayer.") :]] = v
        elif k.startswith("extra_layers."):
            j, rest = k[len("extra_layers.") :].split(".", 1)
            out[extra.format(i=int(j) + 1) + rest] = v
        else:
            out[k] = v
    return out


def _aux_nested(drafter: Eagle3Drafter) -> dict:
    ids = drafter.config.aux_layer_ids
    return {} if ids is None else {"eagle_aux_hidden_state_layer_ids": [b - 1 for b in ids]}


def write_layout(drafter: Eagle3Drafter, layout: str, folder: Path, *, with_embed: bool = False) -> Path:
    """Write ``drafter`` to ``folder`` in ``layout`` (one of :data:`LAYOUTS` or ``torchspec``)."""
    folder.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    state = canonical_state(drafter)
    if not with_embed:
        state.pop("embed_tokens.weight")
    if layout == "eagle":  # SafeAILab EAGLE traineagle3: LlamaForCausalLM template, torch pickle
        cfg = _flat_config(drafter, ["LlamaForCausalLM"])
        torch.save(state, folder / "pytorch_model.bin")
    elif layout in ("specforge", "specforge_sharded", "torchspec"):
        cfg = _flat_config(drafter, ["LlamaForCausalLMEagle3"])
        if eagle := _aux_nested(drafter):
            cfg["eagle_config"] = eagle
        if layout == "torchspec":
            cfg["lm_head_rank_divisor"] = c.hidden_size // c.head_rank
        if layout == "specforge_sharded":
            keys = list(state)
            shards = {
                "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
                "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
            }
            for name, ks in shards.items():
                save_file({k: state[k] for k in ks}, str(folder / name), metadata={"format": "pt"})
            index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    elif layout == "speculators":
        layer_cfg = {
            k: v
            for k, v in _flat_config(drafter, ["LlamaForCausalLM"]).items()
            if k not in ("architectures", "draft_vocab_size", "target_hidden_size")
        }
        cfg = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0",
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]},
            },
            "transformer_layer_config": layer_cfg,
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": c.norm_before_residual,
            "norm_before_fc": c.norm_before_fc,
            "fc_norm": c.fc_norm,
            "norm_output": c.norm_output_postnorm,
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids) if c.aux_layer_ids else None,
        }
        state = _layer_renamed(canonical_state(drafter), "layers.0.", "layers.{i}.")  # ships the embedding
        save_file(state, str(folder / "model.safetensors"))
    elif layout == "modelopt":  # current exporter: layers.N keys, no t2d, ModelOpt eagle_config switches
        cfg = _flat_config(drafter, ["LlamaForCausalLMEagle3"])
        cfg["eagle_config"] = {
            **_aux_nested(drafter),
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": c.has_final_norm,
            "use_mtp_layernorm": False,
            "next_layer_regular": True,
            "parallel_draft_step": 1,
        }
        state = _layer_renamed(state, "layers.0.", "layers.{i}.")
        state.pop("t2d", None)
        save_file(state, str(folder / "model.safetensors"))
    elif layout == "vllm":  # vLLM's names: model. prefix, fused qkv / gate_up, draft_id_to_target_id, no t2d
        cfg = _flat_config(drafter, ["Eagle3LlamaForCausalLM"])
        if c.aux_layer_ids:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(c.aux_layer_ids)
        renamed = _layer_renamed(state, "layers.0.", "layers.{i}.")
        out = {}
        for k, v in renamed.items():
            if ".self_attn.q_proj." in k:
                kv = k.replace(".q_proj.", ".k_proj."), k.replace(".q_proj.", ".v_proj.")
                out["model." + k.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                    [v, renamed[kv[0]], renamed[kv[1]]]
                )
            elif ".mlp.gate_proj." in k:
                out["model." + k.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                    [v, renamed[k.replace(".gate_proj.", ".up_proj.")]]
                )
            elif ".k_proj." in k or ".v_proj." in k or ".mlp.up_proj." in k or k == "t2d":
                continue
            elif k == "d2t":
                out["draft_id_to_target_id"] = v
            elif k.startswith("lm_head."):
                out[k] = v
            else:
                out["model." + k] = v
        save_file(out, str(folder / "model.safetensors"))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def save_tiny_target(model, folder: Path) -> Path:
    """An HF folder (config.json + model.safetensors) of a tiny target."""
    model.save_pretrained(folder, safe_serialization=True)
    return folder
