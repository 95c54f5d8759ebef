"""How to decode: the draft shape (:class:`DraftConfig`), sampling (:class:`SamplingConfig`) and
``slimspec generate``'s own options (:class:`GenerateConfig`). Each validates itself and names the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from slimspec_convert.devices import AUTO_DTYPE, check_device_name, check_run_dtype
from slimspec_convert.model.head import DEFAULT_RERANK_CONTEXT
from slimspec_convert.targets.linear_product import check_linear_product

AUTO_DRAFT = "auto"  # --draft auto: the shape and lookup planned on this machine (measure.draft_shape)
DRAFT_METHODS = (AUTO_DRAFT, "tree", "chain")  # what --draft takes; auto is the default


def check_draft_method(owner: str, value: str) -> None:
    """Raise ``ValueError`` naming ``owner.draft_method`` unless ``value`` is one of :data:`DRAFT_METHODS`."""
    if value not in DRAFT_METHODS:
        raise ValueError(f"{owner}.draft_method={value!r}: expected one of {', '.join(DRAFT_METHODS)}")


@dataclass(frozen=True)
class DraftConfig:
    """How the drafter proposes tokens each round (EAGLE-2/3 dynamic tree, or a chain).

    ``depth`` draft steps; tree drafting expands the ``top_k`` best nodes per step and keeps the
    ``total_tokens`` best by cumulative log-probability (EAGLE's ``total_token`` minus the root).
    These defaults (a 16-node tree of depth 5) are one fixed shape; ``slimspec generate``, ``bench e2e``
    and ``speculative_generate`` plan the shape and the lookup per machine by default (``--draft auto``,
    :mod:`slimspec_convert.measure.draft_shape`).

    ``lookup`` > 0 adds up to that many prompt-lookup tokens per round as one more branch from the
    root (:mod:`slimspec_convert.decoding.lookup`): the tokens after the most recent earlier match of
    the last ``lookup_max_ngram`` .. ``lookup_min_ngram`` tokens (vLLM's ``prompt_lookup_max`` /
    ``prompt_lookup_min``). Lossless; a sampled chain cannot take it (use a tree).
    """

    method: str = "tree"
    depth: int = 5
    top_k: int = 4
    total_tokens: int = 16
    lookup: int = 0
    lookup_min_ngram: int = 2
    lookup_max_ngram: int = 3

    def __post_init__(self) -> None:
        if self.method not in ("tree", "chain"):
            raise ValueError(f"DraftConfig.method={self.method!r}: expected tree or chain")
        if self.depth < 1:
            raise ValueError(f"DraftConfig.depth={self.depth}: expected >= 1")
        if self.top_k < 1:
            raise ValueError(f"DraftConfig.top_k={self.top_k}: expected >= 1")
        if self.total_tokens < 1:
            raise ValueError(f"DraftConfig.total_tokens={self.total_tokens}: expected >= 1")
        if self.lookup < 0:
            raise ValueError(f"DraftConfig.lookup={self.lookup}: expected >= 0 (0 = off)")
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError(
                f"DraftConfig.lookup_min_ngram={self.lookup_min_ngram}, lookup_max_ngram="
                f"{self.lookup_max_ngram}: expected 1 <= min <= max"
            )


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding: temperature 0 is greedy; otherwise lossless speculative sampling from the target's
    distribution after temperature, top-k and top-p (transformers' warpers, in that order; the drafter
    proposes from its own logits processed the same way)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    top_k: int = 0  # sampling top-k (0 = off); not DraftConfig.top_k, the tree's branching

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature}: expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p}: expected 0 < P <= 1")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k}: expected >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens}: expected >= 1")


def check_lookup_sampling(draft: DraftConfig, sampling: SamplingConfig) -> None:
    """Refuse prompt lookup with a sampled chain (a drafter is assumed).

    Raises:
        ValueError: ``draft.lookup > 0``, ``draft.method == "chain"`` and ``sampling.temperature > 0``:
            sampled chain drafts are not point-mass proposals, so they cannot share a verification
            tree with the deterministic lookup branch.
    """
    if draft.lookup and draft.method == "chain" and sampling.temperature > 0:
        raise ValueError(
            f"DraftConfig.lookup={draft.lookup} with a chain and temperature {sampling.temperature}: sampled "
            "chain drafts cannot share a tree with the deterministic lookup branch; draft with "
            "method='tree' (--draft tree) or set lookup=0 (--lookup 0)"
        )


# ---- generate (issue 3) --------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerateConfig:
    """Options of ``slimspec generate`` besides the shape (:class:`DraftConfig`) and decoding
    (:class:`SamplingConfig`): how the draft is chosen, prompt handling, batching, the device and the
    dtype of both models (``auto``: bfloat16 on CUDA, float32 on the CPU).

    ``draft_method`` ``auto`` (the default) plans the shape and the prompt lookup on this machine, on
    held-out calibration prompts (``auto_prompts``, None: the repository's held-out training prompts;
    :mod:`slimspec_convert.measure.draft_shape`); ``tree`` or ``chain`` take the shape of the
    :class:`DraftConfig` given. ``lookup`` sets the prompt lookup by hand (0 = off); None lets ``auto``
    plan it, and means off with a shape set by hand.
    """

    draft_method: str = AUTO_DRAFT
    lookup: int | None = None
    auto_prompts: str | None = None
    chat: bool | None = None  # chat template / completion prompts; None: the tokenizer decides
    system_prompt: str | None = None  # None keeps the chat template's own default
    all_turns: bool = False
    batch_size: int = 1
    dtype: str = AUTO_DTYPE
    device: str = "auto"
    max_prompts: int | None = None
    rerank: int = 0  # low-rank head: rescore its top-k logits exactly (0 = off)
    rerank_context: int = DEFAULT_RERANK_CONTEXT  # with rerank: also the sequence's last C distinct tokens
    linear_product: str = "auto"  # slimspec_convert.targets.linear_product: auto, torch or transposed

    def __post_init__(self) -> None:
        check_draft_method("GenerateConfig", self.draft_method)
        if self.lookup is not None and self.lookup < 0:
            raise ValueError(
                f"GenerateConfig.lookup={self.lookup}: expected >= 0 (0 = off) or None (planned)"
            )
        check_linear_product("GenerateConfig", self.linear_product)
        if self.rerank < 0:
            raise ValueError(f"GenerateConfig.rerank={self.rerank}: expected >= 0 (0 = off)")
        if self.rerank_context < 0:
            raise ValueError(f"GenerateConfig.rerank_context={self.rerank_context}: expected >= 0 (0 = off)")
        if self.batch_size < 1:
            raise ValueError(f"GenerateConfig.batch_size={self.batch_size}: expected >= 1")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"GenerateConfig.max_prompts={self.max_prompts}: expected >= 1")
        if self.all_turns and self.chat is False:
            raise ValueError("GenerateConfig.all_turns needs chat (multi-turn prompts use the chat template)")
        check_run_dtype("GenerateConfig", self.dtype)
        check_device_name("GenerateConfig", self.device)
