"""Checkpoint file names and tensor keys: the only module that spells them (STYLE.md section 6)."""

from __future__ import annotations

import re

from slimspec_convert.checkpoint.weightfiles import (  # noqa: F401
    CheckpointError,
    TensorRef,
    read_safetensors_header,
    write_safetensors,
)

CONFIG_NAME = "config.json"


WEIGHTS_NAME = "model.safetensors"


SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"


BIN_NAME = "pytorch_model.bin"


BIN_INDEX_NAME = "pytorch_model.bin.index.json"


REPORT_NAME = "slimspec_report.json"


SLIMSPEC_SECTION = "slimspec"


# In the slimspec section: the weights hold no lm_head; it is the target's, borrowed at load time.
HEAD_FROM_TARGET = "lm_head_from_target"


EMBED_KEY = "embed_tokens.weight"


LM_HEAD_KEY = "lm_head.weight"


LM_HEAD_DOWN_KEY = "lm_head.down.weight"


LM_HEAD_UP_KEY = "lm_head.up.weight"


D2T_KEY = "d2t"


T2D_KEY = "t2d"


FC_KEY = "fc.weight"


FC_BIAS_KEY = "fc.bias"


NORM_KEY = "norm.weight"


INPUT_NORM_KEY = "input_norm.weight"  # norm_before_fc


FC_NORM_PREFIX = "fc_norm."  # fc_norm.{k}.weight


FIRST_LAYER_PREFIX = "midlayer."  # canonical first decoder layer (EAGLE / SpecForge spelling)


EXTRA_LAYER_PREFIX = "extra_layers."  # canonical layers >= 1, as extra_layers.{i-1}.


VLLM_D2T_KEY = "draft_id_to_target_id"


# config.json architectures[0] of a dense EAGLE-3 drafter (SpecForge / SGLang / vLLM read it).
DENSE_ARCHITECTURE = "LlamaForCausalLMEagle3"


# architectures[0] of a low-rank drafter: vLLM resolves it only with the slimspec plugin installed
# (slimspec_convert/engines/vllm); without it vLLM stops with "architectures ... are not supported".
LOWRANK_ARCHITECTURE = "SlimSpecLlamaForCausalLMEagle3"


# Layer prefixes of the published dialects (eagle3-formats.md P1, P2): midlayer.* (EAGLE, SpecForge),
# midlayer.{i}.* (old ModelOpt), layers.{i}.* (speculators, ModelOpt), model.layers.{i}.* (vLLM).
LAYER_KEY_RE = re.compile(r"^(?:midlayer\.(\d+)\.|midlayer\.|layers\.(\d+)\.)(.*)$")


MIDLAYER_PREFIX = "midlayer."


LAYERS_PREFIX = "layers."


MODEL_PREFIX = "model."


VLLM_FUSED = {  # vLLM fused projections -> their parts, in row order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


TARGET_EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight")


TARGET_HEAD_KEY = "lm_head.weight"
