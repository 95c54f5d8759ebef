"""Which inference engines can load a drafter folder as it is (``slimspec inspect``).

Read from ``config.json`` and the weight-file headers only (plus ``d2t``, a few KB); nothing here
imports an engine. The rules follow the engines' own loaders:

* our engine (``slimspec generate`` / :class:`~slimspec_convert.SpeculativeGenerator`) and the
  transformers drop-in (``speculative_generate``) load every folder :func:`inspect_drafter` reads;
* vLLM 0.32 (``vllm/model_executor/models/llama_eagle3.py``): ``Eagle3LlamaForCausalLM`` builds a
  dense ``ParallelLMHead(draft_vocab_size, hidden_size)``, creates ``draft_id_to_target_id`` only
  when ``draft_vocab_size != vocab_size`` but renames any ``d2t`` it finds (so an all-zero ``d2t``
  at full vocabulary, as SpecForge writes, is refused), and maps ``midlayer.*`` / ``layers.{i}.*``;
* vLLM with the slimspec plugin (``slimspec_convert/engines/vllm``): also resolves
  :data:`LOWRANK_ARCHITECTURE`, a low-rank head ``lm_head.down`` / ``lm_head.up``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slimspec_convert.checkpoint.canonical import LoadReport
from slimspec_convert.checkpoint.folders import open_weights, read_config
from slimspec_convert.checkpoint.names import (
    D2T_KEY,
    EXTRA_LAYER_PREFIX,
    LM_HEAD_DOWN_KEY,
    LM_HEAD_KEY,
    LOWRANK_ARCHITECTURE,
    MODEL_PREFIX,
    VLLM_D2T_KEY,
)

ENGINES = ("slimspec", "transformers", "vllm+plugin", "vllm")

# Architecture names vLLM 0.32 maps to Eagle3LlamaForCausalLM for method "eagle3" (registry.py; a
# plain "LlamaForCausalLM" becomes "Eagle3LlamaForCausalLM" in vllm/transformers_utils/configs/eagle.py).
VLLM_DENSE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")

# Dialects whose tensor names vLLM's Eagle3LlamaForCausalLM.load_weights maps (midlayer.*, layers.0.*).
VLLM_FORMATS = ("slimspec", "specforge", "eagle", "vllm", "torchspec")


@dataclass(frozen=True)
class EngineSupport:
    """Whether one engine loads a folder unchanged.

    Attributes:
        engine: one of :data:`ENGINES` ("vllm" is stock vLLM, "vllm+plugin" vLLM with this package).
        loads: True when the engine loads the folder with no edit.
        why: the rule that decided, and the fix when ``loads`` is False.
    """

    engine: str
    loads: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def engine_support(path: str | Path, report: LoadReport) -> list[EngineSupport]:
    """Which engines load the folder ``path`` as it is.

    Args:
        path: drafter folder that :func:`~slimspec_convert.checkpoint.load.inspect_drafter` read.
        report: that call's :class:`LoadReport` (format, geometry, borrowed tensors).

    Returns:
        One :class:`EngineSupport` per engine of :data:`ENGINES`, in that order.

    Raises:
        CheckpointError: unreadable config.json or weight files (as ``inspect_drafter``).
    """
    folder = Path(path)
    config = read_config(folder)
    refs, _ = open_weights(folder)
    keys = {k[len(MODEL_PREFIX) :] if k.startswith(MODEL_PREFIX) else k: ref for k, ref in refs.items()}
    borrowed = _borrowed(report)
    borrow = f" (borrows {', '.join(borrowed)} from the target)" if borrowed else ""
    ours = f"load_drafter reads the {report.source_format} layout{borrow}"
    out = [EngineSupport("slimspec", True, ours), EngineSupport("transformers", True, ours)]
    plugin, stock = _vllm_rules(config, keys, report)
    return out + [plugin, stock]


def _vllm_rules(
    config: dict[str, Any], keys: dict[str, Any], report: LoadReport
) -> tuple[EngineSupport, ...]:
    """(vllm+plugin, vllm) for a folder: see the module docstring for the rules."""
    cfg = report.config
    arch = (config.get("architectures") or [""])[0]
    if any(k.startswith(EXTRA_LAYER_PREFIX) for k in keys):
        why = f"'{EXTRA_LAYER_PREFIX}*' keys: vLLM's EAGLE-3 loader does not map layers >= 1 in this layout"
        return EngineSupport("vllm+plugin", False, why), EngineSupport("vllm", False, why)
    if report.source_format not in VLLM_FORMATS:
        why = f"{report.source_format} layout: not checked here; `slimspec convert` writes one vLLM loads"
        return EngineSupport("vllm+plugin", False, why), EngineSupport("vllm", False, why)
    if LM_HEAD_DOWN_KEY in keys or cfg.head_rank is not None:
        if arch != LOWRANK_ARCHITECTURE:
            why = (
                f"low-rank head under architectures[0]={arch!r}: vLLM would build a dense head; "
                "`slimspec fix-vllm SRC OUT` names the plugin's architecture"
            )
            return EngineSupport("vllm+plugin", False, why), EngineSupport("vllm", False, why)
        return (
            EngineSupport("vllm+plugin", True, f"{LOWRANK_ARCHITECTURE}: low-rank head, r={cfg.head_rank}"),
            EngineSupport("vllm", False, f"{LOWRANK_ARCHITECTURE} is registered only by the slimspec plugin"),
        )
    if arch not in VLLM_DENSE_ARCHITECTURES:
        why = f"architectures[0]={arch!r} is none of vLLM's EAGLE-3 Llama names {VLLM_DENSE_ARCHITECTURES}"
        return EngineSupport("vllm+plugin", False, why), EngineSupport("vllm", False, why)
    d2t_key = D2T_KEY if D2T_KEY in keys else VLLM_D2T_KEY if VLLM_D2T_KEY in keys else None
    if d2t_key is not None and not cfg.is_trimmed:
        why = (
            f"'{d2t_key}' at full vocabulary (draft_vocab_size == vocab_size == {cfg.vocab_size}): vLLM has "
            "no parameter for it; `slimspec fix-vllm SRC OUT` drops it"
        )
        return EngineSupport("vllm+plugin", False, why), EngineSupport("vllm", False, why)
    head = "borrows the target's lm_head" if LM_HEAD_KEY in _borrowed(report) else "dense lm_head"
    why = f"{arch}: Eagle3LlamaForCausalLM, {head}"
    return EngineSupport("vllm+plugin", True, why), EngineSupport("vllm", True, why)


def _borrowed(report: LoadReport) -> list[str]:
    """Canonical keys the folder lacks and a loader takes from the target (inspect or load reports)."""
    needed = [k for k, v in report.tensors.items() if v.startswith("needs the target")]
    return needed or list(report.borrowed)
