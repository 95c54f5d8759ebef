"""The vLLM plugin: serve SlimSpec low-rank EAGLE-3 drafters in vLLM.

Installed with the package, it is found through the entry point group ``vllm.general_plugins``
(``pyproject.toml``), which vLLM loads in every process it starts (``vllm/plugins/__init__.py``).
:func:`register` only names the model class by a ``"module:Class"`` string: vLLM imports
:mod:`slimspec_convert.engines.vllm.model` (and vLLM's model code with it) when a drafter's
``config.json`` names :data:`ARCHITECTURE`, never at registration.
"""

from __future__ import annotations

from slimspec_convert.checkpoint.names import LOWRANK_ARCHITECTURE

ARCHITECTURE = LOWRANK_ARCHITECTURE

MODEL_CLASS = "slimspec_convert.engines.vllm.model:SlimSpecEagle3LlamaForCausalLM"


def register() -> None:
    """Register :data:`ARCHITECTURE` in vLLM's ``ModelRegistry`` (lazily, by name); idempotent.

    Raises:
        ImportError: vLLM is not installed (the entry point only runs inside vLLM).
    """
    from vllm import ModelRegistry  # vLLM calls this hook; the import is vLLM's own, already loaded

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
