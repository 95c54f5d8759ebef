"""Which drafter parameters a run trains (head, LoRA, body, all), LoRA merging, and frozen copies."""

from __future__ import annotations

import copy

from torch import Tensor, nn

from finetune.config import FinetuneConfig
from slimspec_convert.checkpoint.load import build_drafter
from slimspec_convert.model.drafter import Eagle3Drafter

LORA_MODULES = r"midlayer\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"


def set_trainable(drafter: Eagle3Drafter, cfg: FinetuneConfig) -> nn.Module:
    """Freeze/unfreeze per ``cfg.train``; inject LoRA with peft for ``head+lora``.

    Embeddings always stay frozen (every upstream trainer freezes them; eagle3-formats.md s. 5).

    Returns:
        The module to train (the drafter itself; LoRA layers are injected in place).
    """
    for p in drafter.parameters():
        p.requires_grad_(False)
    if cfg.train == "head+lora":
        from peft import LoraConfig, inject_adapter_in_model

        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=LORA_MODULES,
            lora_dropout=0.0,
            bias="none",
        )
        inject_adapter_in_model(lora, drafter)
        for n, p in drafter.named_parameters():
            p.requires_grad_("lora_" in n)
    for n, p in drafter.named_parameters():
        if n.startswith("embed_tokens."):
            continue
        is_head = n.startswith("lm_head.")
        if cfg.train in ("head", "head+lora") and is_head:
            p.requires_grad_(True)
        elif cfg.train == "all" or (cfg.train == "body" and not is_head and "lora_" not in n):
            p.requires_grad_(True)
    return drafter


def merged_state_dict(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    """Canonical state dict with any LoRA adapters merged into their base weights."""
    from peft.tuners.lora import LoraLayer

    state = {k: v for k, v in drafter.state_dict().items() if "lora_" not in k}
    for name, module in drafter.named_modules():
        if isinstance(module, LoraLayer):
            base = state.pop(f"{name}.base_layer.weight")
            delta = module.get_delta_weight("default").to(base.dtype)
            state[f"{name}.weight"] = base + delta
            if f"{name}.base_layer.bias" in state:
                state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")
    return state


def export_drafter(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """A plain (LoRA-merged) copy of the drafter for saving or inference."""
    if not any("lora_" in n for n, _ in drafter.named_parameters()):
        return drafter
    state = merged_state_dict(drafter)
    return build_drafter(drafter.config, state, embed_from=None, where="merged LoRA drafter")


def copy_head(drafter: Eagle3Drafter) -> nn.Module:
    """A frozen copy of the drafter's current head (the teacher for ``--teacher drafter``)."""
    head = copy.deepcopy(drafter.lm_head)
    for p in head.parameters():
        p.requires_grad_(False)
    return head
