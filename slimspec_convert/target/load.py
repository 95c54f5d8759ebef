"""Loading the target and its tokenizer: a local Hugging Face folder, a ``.gguf`` file or a hub id."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from transformers.utils import CONFIG_NAME

from slimspec_convert.devices import resolve_device, resolve_dtype


def load_target(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device | None = "cpu"
):
    """Load a target model and its tokenizer from a local folder, a ``.gguf`` file or a hub id.

    Args:
        path: HF folder (config.json + weights + tokenizer), a GGUF file (loaded through
            transformers' ``gguf_file=``, dequantised), or a hub id where a network exists.
        dtype: ``auto`` / None (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16 or float16.
        device: where the model is placed: ``cpu`` (default), ``cuda``, ``cuda:N`` or ``auto``
            (:func:`~slimspec_convert.devices.resolve_device`).

    Returns:
        (model in eval mode on ``device``, tokenizer).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: unknown dtype or device, or cuda asked for without one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device_ = resolve_device(device)
    dtype_ = resolve_dtype(dtype, device_)
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p}: GGUF file not found")
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype_)
    else:
        if (str(path).startswith((".", "/")) or p.exists()) and not (p / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{p}: not a model folder (no config.json)")
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype_)
    model.to(device_).eval()
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


def load_tokenizer(target: str | Path):
    """The target's tokenizer alone (no weights): HF folder, ``.gguf`` file or hub id.

    Raises:
        FileNotFoundError: a local path that does not exist.
    """
    from transformers import AutoTokenizer

    p = Path(target)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p}: GGUF file not found")
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    if str(target).startswith((".", "/")) and not p.exists():
        raise FileNotFoundError(f"{p}: target folder not found")
    return AutoTokenizer.from_pretrained(str(target))
