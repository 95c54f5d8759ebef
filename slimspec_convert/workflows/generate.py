"""``slimspec generate`` as a workflow: load the target and the drafter, cast, rerank, decode."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.decoding.config import AUTO_DRAFT, DraftConfig, GenerateConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator, eos_notice
from slimspec_convert.decoding.hf_generate import TextChunkStreamer, streaming_hooks
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.decoding.results import GenerationResult
from slimspec_convert.measure.draft_shape import (
    AUTO_LOOKUPS,
    DraftPlan,
    calibration_prompts,
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
    scfg: SamplingConfig,
    *,
    lookup: int | None = None,
    grams: DraftConfig | None = None,
    calibration: str | Path | None = None,
    on_plan: Callable[[DraftPlan], None] | None = None,
    chat: bool | None = None,
) -> DraftConfig:
    """``--draft auto``: the shape and prompt lookup that
    :func:`~slimspec_convert.measure.draft_shape.plan_draft_shape` picks (cached per machine, drafter and
    calibration prompts).

    Args:
        model, tokenizer, drafter: the target, its tokenizer and the drafter (None: the target alone,
            nothing to plan: plain decoding, or prompt lookup alone when ``lookup`` is set).
        scfg: sampling; with ``temperature > 0`` the plan (made for greedy acceptance, a proxy) keeps
            the lookup off, since a sampled chain cannot take it.
        lookup: prompt-lookup tokens set by hand (0 = off); None plans it among
            :data:`~slimspec_convert.measure.draft_shape.AUTO_LOOKUPS`.
        grams: the lookup's n-gram fields (``lookup_min_ngram``, ``lookup_max_ngram``); None: defaults.
        calibration: prompt file to plan on (None: the held-out training prompts,
            :func:`~slimspec_convert.measure.draft_shape.calibration_prompts`); never evaluation prompts.
        on_plan: called with the plan before decoding.
        chat: chat template or completion prompts (None: the tokenizer decides).

    Raises:
        ValueError: a hand-set lookup with sampling (give ``--draft tree``); bad calibration prompts.
        FileNotFoundError: the default calibration prompts are missing (a wheel install).
    """
    grams = grams or DraftConfig()
    if drafter is None:
        return replace(grams, lookup=lookup or 0)
    lookups = AUTO_LOOKUPS if lookup is None else (lookup,)
    if scfg.temperature > 0:
        if lookup:
            raise ValueError(
                f"--draft auto with --lookup {lookup} and --temperature {scfg.temperature}: a sampled chain "
                "cannot take the lookup branch; give --draft tree (or --lookup 0)"
            )
        lookups = (0,)
    plan = plan_draft_shape(
        model,
        tokenizer,
        drafter,
        calibration_prompts(calibration, chat=resolve_chat(tokenizer, chat).chat),
        lookup=grams,
        lookups=lookups,
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
    dcfg: DraftConfig,
    scfg: SamplingConfig,
    on_text: Callable[[str], None] | None = None,
    on_plan: Callable[[DraftPlan], None] | None = None,
    on_linear: Callable[[LinearProductChoice], None] | None = None,
    on_mode: Callable[[PromptMode], None] | None = None,
) -> list[GenerationResult]:
    """Decode one prompt or a prompt file with the target alone or with a drafter.

    Args:
        target: HF folder, ``.gguf`` file or hub id.
        drafter: drafter folder, or None / ``"none"``.
        prompt: one prompt (exactly one of ``prompt`` and ``prompts``).
        prompts: JSONL with ``prompt`` or MT-Bench ``turns``.
        gcfg, dcfg, scfg: how the draft is chosen (``gcfg.draft_method``: ``auto``, the default, plans
            it with :func:`auto_draft`; ``tree`` or ``chain`` take ``dcfg``), prompt handling and dtype;
            the draft shape (with auto only its lookup n-gram fields count); sampling.
        on_text: stream the output: called with each piece of text as its tokens are committed
            (special tokens skipped, so the pieces join into ``result.text``); one prompt only.
        on_plan: called with the :class:`DraftPlan` of ``--draft auto`` before decoding.
        on_linear: called with the linear product set on both models (``gcfg.linear_product``,
            :func:`~slimspec_convert.measure.linear_product.apply_linear_product`) before decoding.
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
    if gcfg.draft_method != AUTO_DRAFT:
        dcfg = replace(dcfg, method=gcfg.draft_method, lookup=gcfg.lookup or 0)
    else:
        dcfg = auto_draft(
            model,
            tokenizer,
            module,
            scfg,
            lookup=gcfg.lookup,
            grams=dcfg,
            calibration=gcfg.auto_prompts,
            on_plan=on_plan,
            chat=mode.chat,
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
