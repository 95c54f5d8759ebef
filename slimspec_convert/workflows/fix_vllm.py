"""``slimspec fix-vllm``: make a drafter folder that vLLM refuses for a format quirk loadable, losslessly.

Two quirks, fixed by one command:

* SpecForge saves ``d2t`` (all zeros: the identity) and ``t2d`` even when the draft vocabulary is
  the target's. vLLM 0.32's ``Eagle3LlamaForCausalLM`` creates ``draft_id_to_target_id`` only when
  ``draft_vocab_size != vocab_size``, yet renames every ``d2t`` it reads to that name, so it stops with
  "There is no module or parameter named 'draft_id_to_target_id'". An all-zero ``d2t`` carries no
  information: it and ``t2d`` are left out.
* A low-rank head (``lm_head.down`` / ``lm_head.up``) under a dense architecture name (folders of
  TorchSpec, or of slimspec before the vLLM plugin): ``config.json`` gets the plugin's architecture
  :data:`LOWRANK_ARCHITECTURE` and ``lm_head_rank``.

Every tensor kept is copied byte for byte; the other files of the folder unchanged.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from slimspec_convert.atomic import atomic_write_json, staged_folder
from slimspec_convert.checkpoint.folders import open_weights, read_config
from slimspec_convert.checkpoint.names import (
    CONFIG_NAME,
    D2T_KEY,
    LM_HEAD_DOWN_KEY,
    LOWRANK_ARCHITECTURE,
    MODEL_PREFIX,
    SAFETENSORS_INDEX_NAME,
    T2D_KEY,
    VLLM_D2T_KEY,
    WEIGHTS_NAME,
    CheckpointError,
    write_safetensors,
)
from slimspec_convert.version import __version__

RANK_FIELD = "lm_head_rank"


@dataclass(frozen=True)
class FixVllmReport:
    """What ``fix-vllm`` did.

    Attributes:
        src: source folder.
        out: written folder.
        dropped: file keys left out (the identity ``d2t`` and its ``t2d``).
        architecture: the architecture now named in config.json, when it was changed (else None).
        num_tensors: tensors copied.
        copied_files: other files copied unchanged (config.json unless renamed, tokenizer files ...).
    """

    src: str
    out: str
    dropped: tuple[str, ...]
    architecture: str | None
    num_tensors: int
    copied_files: tuple[str, ...]

    def summary(self) -> str:
        """One line for the CLI."""
        done = [f"dropped {list(self.dropped)} (identity d2t at full vocabulary)"] if self.dropped else []
        if self.architecture:
            done.append(f"architectures = ['{self.architecture}'] (low-rank head: the slimspec vLLM plugin)")
        return f"{self.out}: {self.num_tensors} tensors copied from {self.src}; " + "; ".join(done)


def fix_vllm(src: str | Path, out: str | Path, *, force: bool = False) -> FixVllmReport:
    """Copy a drafter folder without the quirks vLLM refuses (see the module docstring).

    Args:
        src: drafter folder (safetensors, single file or sharded; any key prefix).
        out: destination folder, written atomically (must not exist unless ``force``).
        force: replace an existing ``out``.

    Returns:
        :class:`FixVllmReport`.

    Raises:
        CheckpointError: nothing to fix (no ``d2t`` at full vocabulary and no misnamed low-rank
            head; the message says why, e.g. a trimmed vocabulary, whose ``d2t`` vLLM needs); a
            non-zero ``d2t`` at full vocabulary (a permutation: dropping it would change the
            drafter); weights that are not safetensors.
        FileExistsError: ``out`` exists and ``force`` is off.
    """
    src, out = Path(src), Path(out)
    config = read_config(src)
    refs, files = open_weights(src)
    if any(f.suffix != ".safetensors" for f in files):
        raise CheckpointError(f"{files[0]}: fix-vllm copies safetensors folders only")
    dropped = _identity_maps(src, config, refs)
    down = next((ref for k, ref in refs.items() if k.removeprefix(MODEL_PREFIX) == LM_HEAD_DOWN_KEY), None)
    arch = (config.get("architectures") or [""])[0]
    rename = down is not None and arch != LOWRANK_ARCHITECTURE
    if not dropped and not rename:
        why = (
            f"architectures[0] is already {LOWRANK_ARCHITECTURE}"
            if down is not None
            else _why_no_d2t(src, config, refs)
        )
        raise CheckpointError(f"{src}: {why}; nothing to fix for vLLM")
    if rename:
        config = {**config, "architectures": [LOWRANK_ARCHITECTURE], RANK_FIELD: int(down.shape[0])}
    kept = [(k, ref) for k, ref in refs.items() if k not in dropped]
    others = [p for p in sorted(src.iterdir()) if p.is_file() and p not in files]
    others = [
        p for p in others if p.name != SAFETENSORS_INDEX_NAME and not (rename and p.name == CONFIG_NAME)
    ]
    with staged_folder(out, force=force) as tmp:
        write_safetensors(tmp / WEIGHTS_NAME, kept, {"format": "pt", "producer": f"slimspec {__version__}"})
        if rename:
            atomic_write_json(tmp / CONFIG_NAME, config)
        for p in others:
            shutil.copyfile(p, tmp / p.name)
    new_arch = LOWRANK_ARCHITECTURE if rename else None
    return FixVllmReport(str(src), str(out), dropped, new_arch, len(kept), tuple(p.name for p in others))


def _d2t_keys(refs: dict) -> list[str]:
    return [k for k in refs if k.removeprefix(MODEL_PREFIX) in (D2T_KEY, VLLM_D2T_KEY)]


def _identity_maps(src: Path, config: dict, refs: dict) -> tuple[str, ...]:
    """Keys of an all-zero ``d2t`` and its ``t2d`` at full vocabulary (() when there is none to drop).

    Raises:
        CheckpointError: a non-zero ``d2t`` at full vocabulary.
    """
    vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size", config.get("vocab_size"))
    if not _d2t_keys(refs) or draft_vocab != vocab:
        return ()
    for key in _d2t_keys(refs):
        if int(torch.count_nonzero(refs[key].load())):
            raise CheckpointError(
                f"{refs[key].where}: '{key}' is not all zero at full vocabulary (a permutation of the ids); "
                "dropping it would change which tokens the drafter proposes"
            )
    return tuple(k for k in refs if k.removeprefix(MODEL_PREFIX) in (D2T_KEY, VLLM_D2T_KEY, T2D_KEY))


def _why_no_d2t(src: Path, config: dict, refs: dict) -> str:
    if not _d2t_keys(refs):
        return f"no '{D2T_KEY}' in the weight files"
    return (
        f"draft_vocab_size={config.get('draft_vocab_size')} != vocab_size={config.get('vocab_size')}: a "
        f"trimmed vocabulary, vLLM needs its '{D2T_KEY}' and loads the folder as it is"
    )
