"""``slimspec fix-vllm``: make a full-vocabulary drafter with an identity ``d2t`` loadable by stock vLLM.

SpecForge saves ``d2t`` (all zeros: the identity) and ``t2d`` even when the draft vocabulary is the
target's. vLLM 0.32's ``Eagle3LlamaForCausalLM`` creates ``draft_id_to_target_id`` only when
``draft_vocab_size != vocab_size``, yet renames every ``d2t`` it reads to that name, so it stops with
"There is no module or parameter named 'draft_id_to_target_id'". An all-zero ``d2t`` carries no
information: this copies the folder without ``d2t`` / ``t2d``, every other tensor byte for byte.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from slimspec_convert.atomic import staged_folder
from slimspec_convert.checkpoint.folders import open_weights, read_config
from slimspec_convert.checkpoint.names import (
    D2T_KEY,
    MODEL_PREFIX,
    SAFETENSORS_INDEX_NAME,
    T2D_KEY,
    VLLM_D2T_KEY,
    WEIGHTS_NAME,
    CheckpointError,
    write_safetensors,
)
from slimspec_convert.version import __version__


@dataclass(frozen=True)
class FixVllmReport:
    """What ``fix-vllm`` did.

    Attributes:
        src: source folder.
        out: written folder.
        dropped: file keys left out (the identity ``d2t`` and its ``t2d``).
        num_tensors: tensors copied.
        copied_files: other files copied unchanged (config.json, tokenizer files, README ...).
    """

    src: str
    out: str
    dropped: tuple[str, ...]
    num_tensors: int
    copied_files: tuple[str, ...]

    def summary(self) -> str:
        """One line for the CLI."""
        return (
            f"{self.out}: {self.num_tensors} tensors copied from {self.src}, dropped {list(self.dropped)} "
            f"(identity d2t at full vocabulary); stock vLLM loads it"
        )


def fix_vllm(src: str | Path, out: str | Path, *, force: bool = False) -> FixVllmReport:
    """Copy a full-vocabulary drafter without its all-zero ``d2t`` and its ``t2d``.

    Args:
        src: drafter folder (safetensors, single file or sharded; any key prefix).
        out: destination folder, written atomically (must not exist unless ``force``).
        force: replace an existing ``out``.

    Returns:
        :class:`FixVllmReport`.

    Raises:
        CheckpointError: no ``d2t`` in the folder (nothing to fix); a trimmed vocabulary
            (``draft_vocab_size != vocab_size``: vLLM needs that ``d2t``); a non-zero ``d2t`` at
            full vocabulary (a permutation: dropping it would change the drafter); weights that
            are not safetensors.
        FileExistsError: ``out`` exists and ``force`` is off.
    """
    src, out = Path(src), Path(out)
    config = read_config(src)
    refs, files = open_weights(src)
    if any(f.suffix != ".safetensors" for f in files):
        raise CheckpointError(f"{files[0]}: fix-vllm copies safetensors folders only")
    d2t_keys = [k for k in refs if k.removeprefix(MODEL_PREFIX) in (D2T_KEY, VLLM_D2T_KEY)]
    if not d2t_keys:
        raise CheckpointError(f"{src}: no '{D2T_KEY}' in the weight files; nothing to fix for vLLM")
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size", config.get("vocab_size"))
    if draft_vocab != vocab:
        raise CheckpointError(
            f"{src / 'config.json'}: draft_vocab_size={draft_vocab} != vocab_size={vocab}: a trimmed "
            f"vocabulary, vLLM needs its '{D2T_KEY}'; the folder loads as it is"
        )
    for key in d2t_keys:
        if int(torch.count_nonzero(refs[key].load())):
            raise CheckpointError(
                f"{refs[key].where}: '{key}' is not all zero at full vocabulary (a permutation of the ids); "
                "dropping it would change which tokens the drafter proposes"
            )
    dropped = tuple(k for k in refs if k.removeprefix(MODEL_PREFIX) in (D2T_KEY, VLLM_D2T_KEY, T2D_KEY))
    kept = [(k, ref) for k, ref in refs.items() if k not in dropped]
    others = [p for p in sorted(src.iterdir()) if p.is_file() and p not in files]
    others = [p for p in others if p.name != SAFETENSORS_INDEX_NAME]
    with staged_folder(out, force=force) as tmp:
        write_safetensors(tmp / WEIGHTS_NAME, kept, {"format": "pt", "producer": f"slimspec {__version__}"})
        for p in others:
            shutil.copyfile(p, tmp / p.name)
    return FixVllmReport(str(src), str(out), dropped, len(kept), tuple(p.name for p in others))
