"""Target adapter: any Hugging Face causal LM -> logits plus the aux hidden states an EAGLE-3
drafter was trained on (eagle3-formats.md sections 5.1 and 6).

Aux states are read from ``output_hidden_states``: HF's ``hidden_states[b]`` is the residual
stream after ``b`` decoder blocks, i.e. *boundary* index ``b`` (``b = 0`` is the embedding output).
For ``b = L`` HF returns the post-final-norm state, while engines capture it before the norm; we
therefore refuse ``b = L`` rather than feed a different feature.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass
class TargetOutput:
    """One target forward.

    Attributes:
        logits: [B, T, V_t] float32.
        aux_hidden: [B, T, K*dt], concatenated in ascending boundary order, model dtype.
        past_key_values: the HF cache after this call (None when not requested).
    """

    logits: Tensor
    aux_hidden: Tensor
    past_key_values: object | None = None


def _dtype(name: str | torch.dtype | None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {None: torch.float32, "float32": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r}: expected one of float32, bfloat16, float16")
    return table[name]


def load_target(path: str | Path, dtype: str | torch.dtype | None = None):
    """Load a target model and its tokenizer from a local folder, a ``.gguf`` file or a hub id.

    Args:
        path: HF folder (config.json + weights + tokenizer), a GGUF file (loaded through
            transformers' ``gguf_file=``, dequantised), or a hub id where a network exists.
        dtype: float32 (default), bfloat16 or float16.

    Returns:
        (model in eval mode, tokenizer).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: unknown dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _dtype(dtype)
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p}: GGUF file not found")
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch_dtype)
    else:
        if (str(path).startswith((".", "/")) or p.exists()) and not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p}: not a model folder (no config.json)")
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def num_target_layers(model) -> int:
    """L, the number of decoder layers of an HF causal LM."""
    return int(model.config.num_hidden_layers)


def target_lm_head(model) -> Tensor:
    """The target's output projection weight, [V_t, dt]."""
    return model.get_output_embeddings().weight


def target_embeddings(model) -> Tensor:
    """The target's input embedding table, [V_t, dt]."""
    return model.get_input_embeddings().weight


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
    kwargs = {}
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        output_hidden_states=True,
        return_dict=True,
        **kwargs,
    )
    aux = torch.cat([out.hidden_states[b] for b in sorted(aux_layers)], dim=-1)  # [B, T, K*dt]
    return TargetOutput(logits=out.logits.float(), aux_hidden=aux, past_key_values=out.past_key_values)
