"""``model.generate(**inputs, custom_generate=speculative_generate, drafter=drafter)``: the callable
transformers calls, with the draft planned by default (``draft="auto"``) as ``slimspec generate`` plans it.

How transformers calls it, what it keeps from a callable and what is refused: the module docstring of
:mod:`slimspec_convert.decoding.hf_generate`, which holds the loop this callable runs. The plan
(:func:`~slimspec_convert.measure.draft_shape.plan_draft_shape`: shape and prompt lookup, on held-out
calibration prompts) is made once per target and drafter in a process and cached on disk per machine, so
only the first call of a new drafter on a new machine pays for it (tens of seconds on two CPU cores).
"""

from __future__ import annotations

import logging
import sys
import weakref

import torch
from torch import Tensor
from transformers import AutoTokenizer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from slimspec_convert.decoding.config import AUTO_DRAFT, DraftConfig
from slimspec_convert.decoding.hf_generate import (
    check_drafter,
    check_options,
    generate_in_hf,
    kept_by_generate,
)
from slimspec_convert.measure.draft_shape import AUTO_LOOKUPS, calibration_prompts, plan_draft_shape
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.targets.load import resolve_chat

logger = logging.getLogger(__name__)

# drafter -> {(id of the target, sampled): planned draft}; dropped with the drafter.
_PLANNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def speculative_generate(
    model,
    input_ids: Tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    drafter: Eagle3Drafter | None,
    draft: DraftConfig | str = AUTO_DRAFT,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    streamer=None,
    **model_kwargs,
) -> Tensor | GenerateDecoderOnlyOutput:
    """Lossless EAGLE-3 speculative decoding as a transformers ``custom_generate`` callable.

    Use: ``model.generate(**inputs, custom_generate=speculative_generate, drafter=drafter,
    max_new_tokens=64)``; greedy output equals plain ``model.generate`` token for token, sampled
    output is distributed as the target's after temperature, top-k and top-p.

    Args:
        model: the HF causal LM (decoder-only), eval mode.
        input_ids: [B, P] int64, left-padded when ``attention_mask`` has zeros.
        logits_processor: prepared by generate(): only temperature, top-k, top-p warpers.
        stopping_criteria: prepared by generate(): max length, eos ids, stop strings.
        generation_config: the merged ``GenerationConfig``.
        drafter: EAGLE-3 drafter in the target's dtype and device (None: the target alone, through
            the same loop).
        draft: ``"auto"`` (the default: the shape and prompt lookup planned on this machine,
            :func:`planned_draft`), a :class:`DraftConfig`, ``"tree"`` or ``"chain"``.
        generator: draws the per-row sampling seeds (sampling only).
        seed: or a seed for them (not with ``generator``); neither: torch's global RNG, so
            ``torch.manual_seed`` before the call makes it reproducible.
        streamer: a transformers streamer; found in generate()'s frame when not passed.
        **model_kwargs: what generate() prepared (``attention_mask``, ``position_ids``, ...).

    Returns:
        [B, P + N] int64 ``sequences`` (prompt as given, then new ids; rows that ended early are
        padded with the pad id), or ``GenerateDecoderOnlyOutput(sequences=...)`` with
        ``return_dict_in_generate=True`` (no scores, no cache). On ``input_ids.device``.

    Raises:
        ValueError: an option that cannot be honoured (named), right padding, a drafter that does
            not fit the target, a streamer with B > 1, ``draft="auto"`` without the target's tokenizer.
    """
    streamer, assistant_model = kept_by_generate(sys._getframe(1), streamer)
    if assistant_model is not None:
        if streamer is not None:
            streamer.end()
        raise ValueError(
            "assistant_model: speculative_generate drafts with drafter=; pass no assistant_model"
        )
    if isinstance(draft, str) and draft == AUTO_DRAFT:
        try:  # refuse what cannot be honoured before planning, which takes a while the first time
            check_drafter(model, drafter)
            check_options(generation_config)
            draft = planned_draft(model, drafter, sampled=bool(generation_config.do_sample))
        except ValueError:
            if streamer is not None:
                streamer.end()  # a streamer's consumer must not wait forever
            raise
    return generate_in_hf(
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        drafter=drafter,
        draft=draft,
        generator=generator,
        seed=seed,
        streamer=streamer,
        model_kwargs=model_kwargs,
    )


def planned_draft(model, drafter: Eagle3Drafter | None, sampled: bool = False) -> DraftConfig:
    """``draft="auto"``: the plan of ``slimspec generate --draft auto`` for this target and drafter.

    Planned on the held-out calibration prompts
    (:func:`~slimspec_convert.measure.draft_shape.calibration_prompts`) with the target's tokenizer
    (read from ``model.name_or_path``); made once per process for a (target, drafter) pair and cached on
    disk per machine. Sampling plans without the prompt lookup (a sampled chain cannot take it).

    Args:
        model: the target.
        drafter: the drafter (None: nothing to plan, ``DraftConfig()``).
        sampled: ``do_sample=True``.

    Returns:
        The :class:`DraftConfig` to decode with.

    Raises:
        ValueError: the target's tokenizer cannot be read from ``model.name_or_path``.
    """
    if drafter is None:
        return DraftConfig()
    memo = _PLANNED.setdefault(drafter, {})
    key = (id(model), sampled)
    if key not in memo:
        name = getattr(model, "name_or_path", "") or ""
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"draft='auto' plans on held-out chat prompts and needs the target's tokenizer, but "
                f"model.name_or_path={name!r} has none ({type(e).__name__}); pass draft=DraftConfig(...) "
                "or 'chain'"
            ) from e
        lookups = (0,) if sampled else AUTO_LOOKUPS
        chat = resolve_chat(tokenizer, None).chat  # as `slimspec generate` renders them: one cached plan
        logger.warning(
            "speculative_generate: draft='auto' plans the draft on held-out prompts (once per machine, "
            "target and drafter, a minute or two on 2 CPU cores; draft=DraftConfig(...) skips it)"
        )
        plan = plan_draft_shape(
            model, tokenizer, drafter, calibration_prompts(chat=chat), lookups=lookups, chat=chat
        )
        logger.warning("speculative_generate: %s", plan.summary())
        memo[key] = plan.draft
    return memo[key]
