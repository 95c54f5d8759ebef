"""``slimspec generate`` as a workflow: load the target and the drafter, cast, rerank, decode."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.decoding.config import DraftConfig, GenerateConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator, eos_notice
from slimspec_convert.decoding.hf_generate import TextChunkStreamer, streaming_hooks
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.decoding.results import GenerationResult
from slimspec_convert.measure.draft_shape import (
    AUTO_CALIBRATION_PROMPTS,
    AUTO_DRAFT,
    DraftPlan,
    plan_draft_shape,
)
from slimspec_convert.measure.linear_product import LinearProductChoice, apply_linear_product
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.targets.load import PromptMode, load_target, resolve_chat

logger = logging.getLogger(__name__)

NO_DRAFTER = "none"  # --drafter none: the target alone


def load_generation_models(target: str | Path, drafter: str | Path | None, gcfg: GenerateConfig):
    """The target, its tokenizer and the drafter in one dtype, ready to decode.

    Args:
        target: HF folder, ``.gguf`` file or hub id.
        drafter: drafter folder (any EAGLE-3 layout); None or ``"none"`` for the target alone.
        gcfg: device, dtype and rerank (``gcfg.rerank`` > 0 rescores a low-rank head's top-k exactly).

    Returns:
        ``(model, tokenizer, drafter or None)``, both models on ``gcfg.device`` in ``gcfg.dtype``
        (``auto``: bfloat16 on CUDA, float32 on the CPU), eval mode.

    Raises:
        ValueError: ``rerank`` without a low-rank drafter (naming the option and the folder); cuda
            asked for without one.
        FileNotFoundError, CheckpointError: unreadable target or drafter.
    """
    model, tokenizer = load_target(target, gcfg.dtype, gcfg.device)
    module: Eagle3Drafter | None = None
    if drafter is not None and str(drafter).lower() != NO_DRAFTER:
        module, _ = load_drafter(drafter, target=model)
        module.to(device=model.device, dtype=model.dtype).eval()  # one device and dtype for both models
        if gcfg.rerank:
            try:
                module.enable_rerank(gcfg.rerank, gcfg.rerank_context)
            except ValueError as e:
                raise ValueError(f"--rerank {gcfg.rerank}: {drafter}: {e}") from e
    elif gcfg.rerank:
        raise ValueError("--rerank needs a low-rank --drafter")
    return model, tokenizer, module


def auto_draft(
    model,
    tokenizer,
    drafter: Eagle3Drafter | None,
    prompts: list[str],
    scfg: SamplingConfig,
    on_plan: Callable[[DraftPlan], None] | None = None,
    calibration: list[str] | None = None,
    lookup: DraftConfig | None = None,
    chat: bool | None = None,
) -> DraftConfig:
    """``--draft auto``: the shape :func:`~slimspec_convert.measure.draft_shape.plan_draft_shape` picks.

    Args:
        calibration: prompts to measure acceptance on (default: the first
            :data:`AUTO_CALIBRATION_PROMPTS` of ``prompts``, whose greedy answers the run then repeats).
        lookup: prompt-lookup fields planned with and kept on the shape (None: no lookup).
        chat: chat template or completion prompts (None: the tokenizer decides).

    Raises:
        ValueError: no drafter, or sampling (the plan predicts greedy acceptance).
    """
    if drafter is None:
        raise ValueError("--draft auto picks a drafter's shape: give --drafter")
    if scfg.temperature > 0:
        raise ValueError(
            "--draft auto plans for greedy decoding; with --temperature > 0 give --draft tree|chain"
        )
    plan = plan_draft_shape(
        model,
        tokenizer,
        drafter,
        (calibration or prompts)[:AUTO_CALIBRATION_PROMPTS],
        lookup=lookup,
        chat=chat,
    )
    if on_plan is not None:
        on_plan(plan)
    return plan.draft


def generate_from_paths(
    target: str | Path,
    drafter: str | Path | None,
    prompt: str | None,
    prompts: str | Path | None,
    gcfg: GenerateConfig,
    dcfg: DraftConfig | str,
    scfg: SamplingConfig,
    on_text: Callable[[str], None] | None = None,
    on_plan: Callable[[DraftPlan], None] | None = None,
    on_linear: Callable[[LinearProductChoice], None] | None = None,
    lookup: DraftConfig | None = None,
    on_mode: Callable[[PromptMode], None] | None = None,
) -> list[GenerationResult]:
    """Decode one prompt or a prompt file with the target alone or with a drafter.

    Args:
        target: HF folder, ``.gguf`` file or hub id.
        drafter: drafter folder, or None / ``"none"``.
        prompt: one prompt (exactly one of ``prompt`` and ``prompts``).
        prompts: JSONL with ``prompt`` or MT-Bench ``turns``.
        gcfg, dcfg, scfg: prompt handling and dtype, draft shape (or ``"auto"``: :func:`auto_draft`),
            sampling.
        on_text: stream the output: called with each piece of text as its tokens are committed
            (special tokens skipped, so the pieces join into ``result.text``); one prompt only.
        on_plan: called with the :class:`DraftPlan` of ``--draft auto`` before decoding.
        on_linear: called with the linear product set on both models (``gcfg.linear_product``,
            :func:`~slimspec_convert.measure.linear_product.apply_linear_product`) before decoding.
        lookup: its prompt-lookup fields (``DraftConfig.lookup`` ...) are planned with and kept on
            the ``auto`` shape (an explicit ``dcfg`` carries its own).
        on_mode: called with the prompt mode (chat template or completion,
            :func:`~slimspec_convert.targets.load.resolve_chat` of ``gcfg.chat``) once the tokenizer is read.

    Returns:
        One :class:`GenerationResult` per prompt (per turn with ``gcfg.all_turns``).

    Raises:
        ValueError: both or neither of prompt and prompts; bad prompt files; bad rerank; streaming
            anything but one prompt.
    """
    if (prompt is None) == (prompts is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
    if on_text is not None and (prompt is None or gcfg.all_turns):
        raise ValueError(
            "--stream prints one prompt's tokens as they come: give --prompt (not --prompts, --all-turns)"
        )
    turns = [(prompt,)] if prompt is not None else load_prompts(prompts, all_turns=gcfg.all_turns)
    if gcfg.max_prompts is not None:
        turns = turns[: gcfg.max_prompts]
    model, tokenizer, module = load_generation_models(target, drafter, gcfg)
    mode = resolve_chat(tokenizer, gcfg.chat)
    if on_mode is not None:
        on_mode(mode)
    if gcfg.all_turns and not mode.chat:
        raise ValueError("--all-turns runs conversations through the chat template; this target has none")
    linear = apply_linear_product(model, [module], gcfg.linear_product)
    if on_linear is not None:
        on_linear(linear)
    if dcfg == AUTO_DRAFT:
        dcfg = auto_draft(
            model, tokenizer, module, [t[0] for t in turns], scfg, on_plan, lookup=lookup, chat=mode.chat
        )
    if (notice := eos_notice(model, tokenizer)) is not None:
        logger.warning("notice: %s", notice)
    gen = SpeculativeGenerator(
        model,
        tokenizer,
        module,
        dcfg,
        scfg,
        chat=mode.chat,
        system_prompt=gcfg.system_prompt,
        batch_size=gcfg.batch_size,
    )
    if gcfg.all_turns:
        return [r for conv in gen.generate_conversations(turns) for r in conv]
    if on_text is None:
        return gen.generate([t[0] for t in turns])
    streamer = TextChunkStreamer(tokenizer, on_text, skip_special_tokens=True)
    results = gen.generate([prompt], streaming_hooks(streamer))
    streamer.end()
    return results
