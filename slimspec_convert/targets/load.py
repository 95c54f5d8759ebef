"""Loading the target and its tokenizer: a local Hugging Face folder, a ``.gguf`` file or a hub id."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import Tensor
from transformers.utils import (
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from slimspec_convert.devices import (
    EmulatedDtypeWarning,
    emulated_dtype_warning,
    resolve_device,
    resolve_dtype,
)

TARGET_WEIGHT_NAMES = (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME)


# config.json fields only EAGLE-3 drafter dialects write (eagle3-formats.md 1-3); no causal LM has them
DRAFTER_CONFIG_FIELDS = ("draft_vocab_size", "truncated_vocab_size", "eagle_config", "speculators_model_type")


DRAFTER_ARCHITECTURE_WORDS = ("eagle", "speculator")


class TargetError(ValueError):
    """A ``--target`` that is not a loadable model; the message names the path and what is wrong."""


def _is_local(path: str | Path) -> bool:
    return str(path).startswith((".", "/", "~")) or Path(path).exists()


def drafter_evidence(config: dict[str, Any]) -> str | None:
    """Why a parsed config.json is an EAGLE-3 drafter's rather than a target's (None: no sign of one)."""
    fields = [k for k in DRAFTER_CONFIG_FIELDS if k in config]
    if fields:
        return f"config.json has {fields}"
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    drafter_archs = [a for a in archs if any(w in a.lower() for w in DRAFTER_ARCHITECTURE_WORDS)]
    return f"architectures={drafter_archs}" if drafter_archs else None


def not_a_drafter(path: Path, evidence: str | None) -> None:
    """Refuse a drafter where a target is expected, naming both roles.

    Raises:
        TargetError: when ``evidence`` is not None.
    """
    if evidence is not None:
        raise TargetError(
            f"{path}: --target is an EAGLE-3 drafter ({evidence}), not a target model; pass the model the "
            "drafter drafts for as --target and the drafter itself as --drafter / SRC"
        )


def check_target_folder(path: str | Path, *, need_weights: bool = True) -> dict[str, Any]:
    """The parsed config.json of a local target folder, refused early when it cannot be a target.

    Args:
        path: a local folder.
        need_weights: also require a weight file (not for a tokenizer-only read).

    Returns:
        The config as a dict.

    Raises:
        FileNotFoundError: no such folder, or no config.json in it.
        TargetError: config.json is not a JSON object with ``model_type``, the folder is a
            drafter's, or it has no weight file.
    """
    p = Path(path).expanduser()
    f = p / CONFIG_NAME
    if not f.is_file():
        raise FileNotFoundError(f"{p}: not a model folder (no {CONFIG_NAME})")
    try:
        config = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TargetError(f"{f}: invalid JSON ({e}); the target's config.json must be a JSON object") from e
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise TargetError(f"{f}: no 'model_type' field; not a Hugging Face model config")
    not_a_drafter(p, drafter_evidence(config))
    if need_weights and not any((p / n).is_file() for n in TARGET_WEIGHT_NAMES):
        raise TargetError(
            f"{p}: no weight file ({', '.join(TARGET_WEIGHT_NAMES)}); not a complete model folder"
        )
    return config


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _hf_load(path: str | Path, what: str, fn, *args, **kwargs):
    """Call a transformers loader; OSError, ValueError or SafetensorError becomes one :class:`TargetError`."""
    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError, SafetensorError) as e:
        where = (
            "a local folder" if _is_local(path) else "not a local path, and the hub id could not be fetched"
        )
        raise TargetError(f"{path}: cannot load the target's {what} ({where}): {_first_line(e)}") from e


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
        FileNotFoundError: a local path that does not exist, or a folder without config.json.
        TargetError: (a ValueError) invalid config.json, a drafter folder, no weights, weights that
            do not cover the model, or a hub id that cannot be fetched (offline).
        ValueError: unknown dtype or device, or cuda asked for without one.

    Warns:
        EmulatedDtypeWarning: bfloat16 or float16 on a CPU without hardware support for it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device_ = resolve_device(device)
    dtype_ = resolve_dtype(dtype, device_)
    slow = emulated_dtype_warning(dtype_, device_)
    if slow:
        warnings.warn(f"{path}: {slow}", EmulatedDtypeWarning, stacklevel=2)
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p}: GGUF file not found")
        tok = _hf_load(p, "tokenizer", AutoTokenizer.from_pretrained, str(p.parent), gguf_file=p.name)
        model = _hf_load(
            p, "weights", AutoModelForCausalLM.from_pretrained, str(p.parent), gguf_file=p.name, dtype=dtype_
        )
    else:
        if _is_local(path):
            check_target_folder(p)
        tok = _hf_load(path, "tokenizer", AutoTokenizer.from_pretrained, str(path))
        model, info = _hf_load(
            path,
            "weights",
            AutoModelForCausalLM.from_pretrained,
            str(path),
            dtype=dtype_,
            output_loading_info=True,
        )
        if info.get("missing_keys"):
            missing = sorted(info["missing_keys"])
            raise TargetError(
                f"{path}: the weights lack {len(missing)} of {type(model).__name__}'s tensors "
                f"({', '.join(missing[:3])}, ...); not a complete target checkpoint"
            )
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
        TargetError: as :func:`load_target`, weights aside.
    """
    from transformers import AutoTokenizer

    p = Path(target)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p}: GGUF file not found")
        return _hf_load(p, "tokenizer", AutoTokenizer.from_pretrained, str(p.parent), gguf_file=p.name)
    if _is_local(target):
        check_target_folder(p, need_weights=False)
    return _hf_load(target, "tokenizer", AutoTokenizer.from_pretrained, str(target))


@dataclass(frozen=True)
class PromptMode:
    """How string prompts and training records are rendered for a target: its chat template or raw text.

    Attributes:
        chat: True = the tokenizer's chat template; False = completion (raw text after ``<bos>``).
        forced: True when ``--chat``/``--no-chat`` chose it, False when the tokenizer did.
    """

    chat: bool
    forced: bool

    def summary(self) -> str:
        """One line for stderr: the mode and why."""
        if self.chat:
            why = "--chat" if self.forced else "the target's tokenizer has a chat template"
            return f"prompts: chat template ({why}; --no-chat gives raw completion prompts)"
        why = "--no-chat" if self.forced else "the target's tokenizer has no chat template"
        return f"prompts: completion, raw text after <bos> ({why}; --chat forces the template)"


def resolve_chat(tokenizer, chat: bool | None = None) -> PromptMode:
    """The one decision between chat prompts and completion prompts for a target.

    Args:
        tokenizer: the target's HF tokenizer (None: prompts are token ids; completion).
        chat: True/False forces a mode (``--chat``/``--no-chat``); None follows the tokenizer:
            chat when it has a ``chat_template``, completion (base models such as Gemma 3 270M) when not.

    Returns:
        :class:`PromptMode`.

    Raises:
        ValueError: ``chat=True`` with a tokenizer that has no chat template.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is None:
        return PromptMode(chat=has_template, forced=False)
    if chat and not has_template:
        raise ValueError(
            "--chat: the target's tokenizer has no chat template (a base model); drop --chat to use "
            "completion prompts"
        )
    return PromptMode(chat=bool(chat), forced=True)


def bos_text(tokenizer) -> str:
    """The ``<bos>`` text the tokenizer puts before raw text on its own (empty when it adds none), so
    ``tokenizer(bos_text(tok) + text, add_special_tokens=False)`` encodes as ``tokenizer(text)``."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_id is None or tokenizer("a")["input_ids"][:1] != [bos_id]:
        return ""
    return tokenizer.bos_token
