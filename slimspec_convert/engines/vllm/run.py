"""Run greedy decoding in vLLM's offline ``LLM`` and read its speculative-decoding counters.

Shared by ``slimspec bench vllm`` (:mod:`slimspec_convert.engines.vllm.bench`) and the vLLM test
tier (tests/vllm). vLLM is imported inside the functions that need it, so :func:`cpu_env` can set
vLLM's environment before the first import.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# vLLM's CPU build on a small shared machine (docs/serving.md): 1 GiB of KV cache, no thread
# pinning (other work shares the cores), the engine in this process (no spawned workers).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

# Counter names of vLLM's spec-decode metrics (vllm/v1/spec_decode/metrics.py).
NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def cpu_env(threads: int | None = None) -> dict[str, str]:
    """Set :data:`CPU_ENV` (where unset) and ``OMP_NUM_THREADS`` in ``os.environ``; call before vLLM loads.

    Args:
        threads: OpenMP threads for vLLM's CPU kernels (None: keep ``OMP_NUM_THREADS``, else 2).

    Returns:
        The values now in effect for those variables.
    """
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    return {k: os.environ[k] for k in (*CPU_ENV, "OMP_NUM_THREADS")}


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters over one run (differences of the cumulative counters).

    Attributes:
        num_drafts: draft rounds (one per request per verification with drafts).
        num_draft_tokens: draft tokens proposed.
        num_accepted: draft tokens accepted.
        accepted_per_pos: accepted tokens at draft position 0, 1, ... (length k).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def mean_acceptance_length(self) -> float | None:
        """``1 + accepted / drafts``: vLLM's mean acceptance length, the same convention as tau
        (accepted drafts + 1 bonus token per verification); None without drafts."""
        return 1 + self.num_accepted / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_per_pos(self) -> list[float]:
        """Share of draft rounds whose position i was accepted, per position."""
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the derived rates."""
        out = asdict(self)
        out["accepted_per_pos"] = list(self.accepted_per_pos)
        out["mean_acceptance_length"] = self.mean_acceptance_length
        out["acceptance_per_pos"] = self.acceptance_per_pos
        return out


def read_counters(llm) -> SpecCounters:
    """The cumulative spec-decode counters of ``llm`` (summed over label sets; zeros without drafter).

    Args:
        llm: a ``vllm.LLM`` built with ``disable_log_stats=False``.
    """
    sums = {NUM_DRAFTS: 0, NUM_DRAFT_TOKENS: 0, NUM_ACCEPTED: 0}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in sums:
            sums[m.name] += int(m.value)
        elif m.name == ACCEPTED_PER_POS:
            per_pos = [a + b for a, b in zip(per_pos or [0] * len(m.values), m.values, strict=True)]
    return SpecCounters(sums[NUM_DRAFTS], sums[NUM_DRAFT_TOKENS], sums[NUM_ACCEPTED], tuple(per_pos))


def counters_between(before: SpecCounters, after: SpecCounters) -> SpecCounters:
    """``after - before`` for every counter."""
    prev = before.accepted_per_pos or (0,) * len(after.accepted_per_pos)
    per_pos = tuple(a - b for a, b in zip(after.accepted_per_pos, prev, strict=True))
    return SpecCounters(
        after.num_drafts - before.num_drafts,
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted - before.num_accepted,
        per_pos,
    )


def speculative_config(drafter: str, num_draft_tokens: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for an EAGLE-3 drafter folder (a low-rank one needs the plugin)."""
    return {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": num_draft_tokens}


def make_llm(
    target: str,
    drafter: str | None = None,
    *,
    num_draft_tokens: int = 3,
    dtype: str = "float32",
    max_model_len: int = 1024,
    max_num_seqs: int = 8,
    seed: int = 0,
):
    """A ``vllm.LLM`` for greedy benchmarks and tests: eager mode, stats on.

    Args:
        target: target folder or hub id.
        drafter: EAGLE-3 drafter folder, or None for plain decoding.
        num_draft_tokens: k, the chain depth (vLLM's ``num_speculative_tokens``).
        dtype: model dtype for both models.
        max_model_len: prompt + output budget per request.
        max_num_seqs: most requests decoded together.
        seed: vLLM's seed (greedy decoding does not use it).

    Returns:
        ``vllm.LLM``.

    Raises:
        Whatever vLLM raises; e.g. a ``ValueError`` naming an unsupported architecture when a low-rank
        drafter is loaded without the plugin.
    """
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if drafter is not None:
        kwargs["speculative_config"] = speculative_config(drafter, num_draft_tokens)
    return LLM(
        model=str(target),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        seed=seed,
        disable_log_stats=False,
        **kwargs,
    )


def release_vllm() -> None:
    """Free vLLM's process-wide state (distributed groups, memory) so the next ``LLM`` starts clean.

    Call it after dropping the last reference to the previous ``LLM`` (``del llm``).
    """
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


@dataclass
class GreedyRun:
    """Outputs and counters of :func:`generate_greedy`.

    Attributes:
        output_ids: new token ids per prompt, in prompt order.
        seconds: wall time of the generate calls.
        new_tokens: generated tokens in all.
        counters: spec-decode counters over the run (zeros for plain decoding).
    """

    output_ids: list[list[int]]
    seconds: float
    new_tokens: int
    counters: SpecCounters = field(default_factory=SpecCounters)

    @property
    def tokens_per_s(self) -> float:
        """new_tokens / seconds."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def generate_greedy(llm, prompt_ids: Sequence[Sequence[int]], max_tokens: int, batch_size: int) -> GreedyRun:
    """Greedy decoding of token-id prompts, ``batch_size`` prompts per ``generate`` call.

    Args:
        llm: ``vllm.LLM``.
        prompt_ids: prompts as token ids (already chat-templated).
        max_tokens: new tokens per prompt (stops earlier at an end-of-sequence token).
        batch_size: prompts per call (1: one at a time).

    Returns:
        :class:`GreedyRun`.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = read_counters(llm)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompt_ids), batch_size):
        chunk = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids[i : i + batch_size]]
        results = llm.generate(chunk, params, use_tqdm=False)
        outputs += [list(r.outputs[0].token_ids) for r in results]
    seconds = time.perf_counter() - start
    counters = counters_between(before, read_counters(llm))
    return GreedyRun(outputs, seconds, sum(len(o) for o in outputs), counters)
