"""SlimSpec inside transformers' own ``generate()``: ``model.generate(**inputs,
custom_generate=speculative_generate, drafter=drafter)`` runs lossless speculative decoding and returns
what ``generate`` returns. The callable itself lives in :mod:`slimspec_convert.workflows.hf_generate`
(it plans ``draft="auto"``, its default, with :mod:`slimspec_convert.measure.draft_shape`); this module
holds what it runs: the checks, the loop (:func:`generate_in_hf`) and streaming.

How transformers calls it (5.x, ``GenerationMixin.generate`` step 9, read in 5.24): after its usual
preparation (generation config merged with the model's and the defaults, special tokens, attention
mask, position ids, max length, logits processors, stopping criteria) a callable ``custom_generate``
is called as ``fn(model, input_ids, logits_processor=..., stopping_criteria=...,
generation_config=..., **own_kwargs, **model_kwargs)``. ``own_kwargs`` are the callable's parameters
that ``_sample`` lacks (here ``drafter``, ``draft``, ``generator``, ``seed``); ``model_kwargs`` hold
``attention_mask`` (None when it is all ones), ``position_ids``, ``logits_to_keep``, an empty
``cache`` and ``use_cache``.

What generate() keeps from a callable: ``_extract_generation_mode_kwargs`` rebuilds the mode kwargs
from the callable's own keys, so ``streamer`` (after generate() has put the prompt into it),
``assistant_model`` and ``tokenizer`` never reach it, and without the tokenizer generate() itself
raises for ``stop_strings`` before the callable runs. The streamer and ``assistant_model`` are
therefore read from generate()'s frame, identified by its code object; a ``streamer`` passed
explicitly (a direct call, or a transformers that forwards it) wins. ``StopStringCriteria`` that do
arrive in ``stopping_criteria`` are honoured token by token.

Every option is either honoured or refused with a ``ValueError`` naming it (:func:`check_options`):
temperature, top-k and top-p are the only logits processing speculative sampling can apply to the
target and the drafter alike (lossless: the output is distributed as the processed target's).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import TextStreamer
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from slimspec_convert.decoding.batch import DecodeHooks
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.model.drafter import Eagle3Drafter

logger = logging.getLogger(__name__)

_HF_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__

# Generation-config fields this adapter honours (the rest must keep their neutral value).
HONOURED = frozenset(
    {
        "max_length",
        "max_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "eos_token_id",
        "pad_token_id",
        "bos_token_id",
        "return_dict_in_generate",
        "stop_strings",
        "disable_compile",  # never compiled
        "transformers_version",
    }
)
# Read only by modes refused here (beam search, assisted generation, encoder-decoder), as in transformers.
INERT = frozenset(
    {
        "early_stopping",
        "length_penalty",
        "num_beam_groups",
        "diversity_penalty",
        "low_memory",
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "assistant_lookbehind",
        "target_lookbehind",
        "max_matching_ngram_size",
        "is_assistant",
        "decoder_start_token_id",
    }
)
# Sampling warpers transformers builds only with do_sample=True.
SAMPLING_ONLY = frozenset({"min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"})
MODEL_KWARGS = frozenset(
    {"attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values", "use_cache"}
)


# ---- the loop behind the callable ----------------------------------------------------------------
def generate_in_hf(
    model,
    input_ids: Tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    drafter: Eagle3Drafter | None,
    draft: DraftConfig | str,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    streamer=None,
    model_kwargs: dict,
) -> Tensor | GenerateDecoderOnlyOutput:
    """What ``speculative_generate`` (:mod:`slimspec_convert.workflows.hf_generate`, the callable
    transformers calls) runs once the draft is known: check, decode, return what generate() returns.

    Args:
        model, input_ids, logits_processor, stopping_criteria, generation_config: as generate() passes
            them (``input_ids`` [B, P] int64, left-padded when ``attention_mask`` has zeros).
        drafter: EAGLE-3 drafter in the target's dtype and device (None: the target alone).
        draft: :class:`DraftConfig`, ``"tree"`` or ``"chain"``.
        generator, seed: the per-row sampling seeds (sampling only; neither: torch's global RNG).
        streamer: a transformers streamer or None.
        model_kwargs: what generate() prepared (``attention_mask``, ``position_ids``, ...).

    Returns:
        [B, P + N] int64 ``sequences`` (prompt as given, then new ids; rows that ended early are
        padded with the pad id), or ``GenerateDecoderOnlyOutput(sequences=...)`` with
        ``return_dict_in_generate=True`` (no scores, no cache). On ``input_ids.device``.

    Raises:
        ValueError: an option that cannot be honoured (named), right padding, a drafter that does
            not fit the target, a streamer with B > 1.
    """
    try:
        gen, prompts, hooks = prepare(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            drafter,
            draft,
            model_kwargs,
        )
        hooks = with_seeds_and_streamer(hooks, gen, len(prompts), generator, seed, streamer)
        results = gen.generate(prompts, hooks)
    finally:
        if streamer is not None:
            streamer.end()  # also on errors: a TextIteratorStreamer consumer must not wait forever
    taus = [r.stats.tau for r in results]
    logger.info("speculative_generate: tau per row %s (accepted drafts + 1 bonus per verification)", taus)
    sequences = padded_sequences(input_ids, [r.output_ids for r in results], pad_id(generation_config))
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def prepare(
    model, input_ids, logits_processor, stopping_criteria, generation_config, drafter, draft, model_kwargs
):
    """Check every option, then build the generator, the prompts and the stop hooks.

    Returns:
        ``(SpeculativeGenerator, prompt ids per row without padding, DecodeHooks with stop_when)``.

    Raises:
        ValueError: see :func:`speculative_generate`.
    """
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            "speculative_generate: encoder-decoder models are not supported (decoder-only targets)"
        )
    check_drafter(model, drafter)
    check_options(generation_config)
    temperature, top_p, top_k = sampling_from(generation_config, logits_processor)
    max_length, eos_ids, stop_strings = stops_from(stopping_criteria, generation_config)
    prompts = prompts_from(input_ids, model_kwargs)
    if isinstance(draft, str):
        draft = DraftConfig(method=draft)
    sampling = SamplingConfig(
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_length - input_ids.shape[1]
    )
    gen = SpeculativeGenerator(
        model, None, drafter, draft, sampling, chat=False, batch_size=len(prompts), stop_ids=eos_ids
    )
    return gen, prompts, DecodeHooks(stop_when=_stop_when(stop_strings, input_ids.tolist()))


# ---- checks ---------------------------------------------------------------------------------------
def check_drafter(model, drafter) -> None:
    """The drafter is an :class:`Eagle3Drafter` (or None) in the target's dtype and on its device.

    Raises:
        ValueError: a tuple (``load_drafter`` returns ``(drafter, report)``), another type, or a
            dtype / device mismatch, naming the fix.
    """
    if drafter is None:
        return
    if isinstance(drafter, tuple):
        raise ValueError("drafter: got a tuple; load_drafter returns (drafter, report), pass the drafter")
    if not isinstance(drafter, Eagle3Drafter):
        raise ValueError(f"drafter: expected an Eagle3Drafter (load_drafter), got {type(drafter).__name__}")
    want = next(model.parameters())
    got = next(drafter.parameters())
    if (got.dtype, got.device) != (want.dtype, want.device):
        raise ValueError(
            f"drafter: dtype {got.dtype} on {got.device}, the target is {want.dtype} on {want.device}; "
            "call drafter.to(model.dtype) (or .to(model.device)) first: load_drafter keeps the stored dtype"
        )


def check_options(generation_config) -> None:
    """Refuse every generation option that is set but not honoured here.

    An option counts as set when it is neither None, False nor transformers' global default.
    Honoured: :data:`HONOURED`; ignored, as transformers ignores them outside their modes:
    :data:`INERT`, and :data:`SAMPLING_ONLY` under greedy decoding. ``use_cache=False`` is refused
    by :func:`prompts_from` (it reaches the callable as a model kwarg).

    Raises:
        ValueError: naming the first such option and its value (num_beams, repetition_penalty,
            output_scores, min_new_tokens, use_cache=False, ...).
    """
    defaults = generation_config._get_default_generation_params()
    sampling = bool(generation_config.do_sample)
    # min_length is derived from min_new_tokens: name what the user wrote first.
    for name, value in sorted(vars(generation_config).items(), key=lambda kv: (kv[0] == "min_length", kv[0])):
        if name.startswith("_") or name in HONOURED or name in INERT:
            continue
        if name in SAMPLING_ONLY and not sampling:
            continue
        if value is not None and value is not False and value != defaults.get(name):
            raise ValueError(
                f"{name}={value!r}: not supported by speculative_generate (lossless speculative decoding "
                "honours max_new_tokens/max_length, eos/pad ids, do_sample with temperature/top_k/top_p, "
                "stop_strings, return_dict_in_generate, streamer); drop it or use plain generate()"
            )


def sampling_from(generation_config, logits_processor) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) from generate()'s processors: temperature 0 when greedy.

    Accepts exactly what generate() builds from the config: Temperature, TopK, TopP warpers, once
    each, in that order, with their default filter value and ``min_tokens_to_keep=1``.

    Raises:
        ValueError: any other processor (user-given ``logits_processor``, ``prefix_allowed_tokens_fn``,
            ...), a warper under greedy decoding, or a warper out of order, naming its class.
    """
    order = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    last = -1
    for proc in logits_processor or ():
        kind = type(proc)
        pos = order.index(kind) if kind in order else -1
        bad = pos <= last or not generation_config.do_sample
        if kind in (TopKLogitsWarper, TopPLogitsWarper):
            bad = bad or proc.filter_value != float("-inf") or proc.min_tokens_to_keep != 1
        if bad:
            raise ValueError(
                f"logits_processor: {kind.__name__} is not supported by speculative_generate (only "
                "do_sample with temperature, top_k, top_p, as generate() builds them); drop it"
            )
        last = pos
        name = ("temperature", "top_k", "top_p")[pos]
        params[name] = getattr(proc, name)
    if not generation_config.do_sample:
        return 0.0, 1.0, 0
    return float(params["temperature"]), float(params["top_p"]), int(params["top_k"])


def stops_from(stopping_criteria, generation_config) -> tuple[int, list[int], list[StopStringCriteria]]:
    """(max_length incl. the padded prompt, eos ids, stop-string criteria) from generate()'s criteria.

    Raises:
        ValueError: any other criterion (``stopping_criteria=`` given by the user, ``max_time``, ...).
    """
    max_length, eos_ids, stop_strings = generation_config.max_length, [], []
    for crit in stopping_criteria or ():
        if isinstance(crit, MaxLengthCriteria):
            max_length = min(max_length, crit.max_length)
        elif isinstance(crit, EosTokenCriteria):
            eos_ids.extend(int(t) for t in torch.as_tensor(crit.eos_token_id).flatten().tolist())
        elif isinstance(crit, StopStringCriteria):
            stop_strings.append(crit)
        else:
            raise ValueError(
                f"stopping_criteria: {type(crit).__name__} is not supported by speculative_generate "
                "(max_new_tokens/max_length, eos_token_id and stop_strings are); drop it"
            )
    return max_length, eos_ids, stop_strings


def prompts_from(input_ids: Tensor, model_kwargs: dict) -> list[list[int]]:
    """Each row's prompt ids without its left padding.

    Args:
        input_ids: [B, P] int64.
        model_kwargs: generate()'s ``attention_mask`` ([B, P], 1 on real tokens, or None),
            ``position_ids`` (must be the ones generate() derives from the mask), an empty cache.

    Raises:
        ValueError: an unknown model kwarg, a filled cache, custom position ids, an empty prompt or
            a mask that is not left padding, naming it.
    """
    extra = sorted(set(model_kwargs) - MODEL_KWARGS)
    if extra:
        raise ValueError(f"{extra[0]}: not supported by speculative_generate (token-id prompts only)")
    if model_kwargs.get("use_cache") is False:
        raise ValueError("use_cache=False: speculative_generate always decodes with a KV cache")
    for key in ("cache", "past_key_values"):
        cache = model_kwargs.get(key)
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(f"{key}: speculative_generate prefills its own cache; pass the whole prompt")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids: expected [B, P] token ids with P >= 1, got shape {list(input_ids.shape)}"
        )
    attn = model_kwargs.get("attention_mask")
    attn = torch.ones_like(input_ids) if attn is None else attn.to(input_ids.device).long()
    if attn.shape != input_ids.shape or not bool(((attn == 0) | (attn == 1)).all()):
        raise ValueError("attention_mask: expected [B, P] of 0/1 matching input_ids")
    if not bool((attn.cummax(-1).values == attn).all()) or not bool(attn[:, -1].all()):
        raise ValueError("attention_mask: expected left padding (tokenizer padding_side='left')")
    pos = model_kwargs.get("position_ids")
    want = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)
    if pos is not None and not torch.equal(pos.to(want.device).expand_as(want), want):
        raise ValueError("position_ids: custom position ids are not supported (they follow the mask)")
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attn, strict=True)]


# ---- hooks and output -----------------------------------------------------------------------------
def kept_by_generate(frame, streamer):
    """(streamer, assistant_model) that transformers' generate() kept from the callable, read from
    its frame when it is the caller (module docstring); an explicit streamer wins."""
    if frame.f_code is not _HF_GENERATE_CODE:
        return streamer, None
    found = frame.f_locals
    return (streamer if streamer is not None else found.get("streamer")), found.get("assistant_model")


def _stop_when(stop_strings: list[StopStringCriteria], padded: list[list[int]]):
    """transformers' stop-string criteria after every token, on what its own loop would show them:
    the padded prompt row plus the output, cut to the last ``maximum_token_len`` ids; or None."""
    if not stop_strings:
        return None
    width = max(crit.maximum_token_len for crit in stop_strings)

    def stop_when(row: int, out: list[int]) -> bool:
        tail = (padded[row] + out[-width:])[-width:]
        ids = torch.tensor([tail], dtype=torch.long)  # [1, <= width]
        return any(bool(crit(ids, None)[0]) for crit in stop_strings)

    return stop_when


def with_seeds_and_streamer(hooks, gen, B, generator, seed, streamer) -> DecodeHooks:
    """``hooks`` with per-row seeds (sampling only: greedy leaves every RNG untouched) and the streamer's
    put.

    Raises:
        ValueError: both generator and seed, or a streamer with B > 1.
    """
    if generator is not None and seed is not None:
        raise ValueError("generator and seed: pass one of them")
    seeds = None
    if not gen.greedy:
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed))
        seeds = torch.randint(0, 2**62, (B,), generator=generator, dtype=torch.int64).tolist()
    on_commit = None
    if streamer is not None:
        if B > 1:
            raise ValueError(f"streamer: streams one row, got a batch of {B}")
        on_commit = streaming_hooks(streamer).on_commit
    return DecodeHooks(seeds=seeds, on_commit=on_commit, stop_when=hooks.stop_when)


def pad_id(generation_config) -> int | None:
    """The id transformers' own loop pads finished rows with (None when the config has none)."""
    pad = getattr(generation_config, "_pad_token_tensor", None)  # what transformers' own loop pads with
    if pad is None:
        pad = generation_config.pad_token_id
    return None if pad is None else int(torch.as_tensor(pad).flatten()[0])


def padded_sequences(input_ids: Tensor, outputs: list[list[int]], pad_id: int | None) -> Tensor:
    """[B, P + N]: the prompt as given, then each row's new ids padded to the longest row."""
    n = max(len(o) for o in outputs)
    if pad_id is None and any(len(o) < n for o in outputs):
        raise ValueError("pad_token_id: needed to pad rows that stopped early; pass pad_token_id")
    new = torch.tensor([o + [pad_id] * (n - len(o)) for o in outputs], dtype=torch.long)  # [B, N]
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


# ---- streaming outside generate() ---------------------------------------------------------------
class TextChunkStreamer(TextStreamer):
    """transformers' ``TextStreamer`` (its incremental detokenisation) handing each finished piece of
    text to ``on_text`` instead of printing it; feed it with :func:`streaming_hooks`.

    Args:
        tokenizer: the target's tokenizer.
        on_text: called with each new piece of text, in order (their concatenation is the text).
        **decode_kwargs: for ``tokenizer.decode`` (e.g. ``skip_special_tokens=True``).
    """

    def __init__(self, tokenizer, on_text: Callable[[str], None], **decode_kwargs) -> None:
        super().__init__(tokenizer, skip_prompt=False, **decode_kwargs)
        self.on_text = on_text

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Pass ``text`` on (TextStreamer's hook; nothing is printed)."""
        if text:
            self.on_text(text)


def streaming_hooks(streamer) -> DecodeHooks:
    """:class:`DecodeHooks` that put each committed token block ([n] int64) into ``streamer``
    (one row: call ``streamer.end()`` after decoding)."""
    return DecodeHooks(on_commit=lambda row, tokens: streamer.put(torch.tensor(tokens, dtype=torch.long)))
