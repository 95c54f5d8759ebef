"""Fixtures of the vLLM tier (tests/vllm): the real SmolLM2-135M-Instruct target in vLLM's CPU build.

Run inside .venv-vllm (``bash scripts/setup_vllm.sh``; ``scripts/test.sh`` runs the tier last). Every
test is skipped, with the reason, where vLLM is not importable. The tier stays small: four short chat
prompts, 32 new tokens, a chain of 3, one ``LLM`` per drafter, freed before the next one is built.
vLLM's environment (:data:`~slimspec_convert.engines.vllm.run.CPU_ENV`) is set here, before vLLM loads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from slimspec_convert.engines.vllm.run import cpu_env, generate_greedy, make_llm, release_vllm

cpu_env()

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "drafters" / "smollm2-135m-eagle3"
PROMPTS = (
    "What is 7 * 8? Answer in one sentence.",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in two sentences.",
)
MAX_TOKENS = 32
DEPTH = 3
BATCH_SIZES = (1, 4)
NO_VLLM = (
    "vLLM is not installed here: run `bash scripts/setup_vllm.sh`, then "
    "`.venv-vllm/bin/python -m pytest -m vllm tests/vllm`"
)
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def run_drafter(target, drafter, prompt_ids) -> dict:
    """Greedy outputs at batch 1 and 4 and the batch-1 spec-decode counters of one LLM (then freed)."""
    llm = make_llm(str(target), None if drafter is None else str(drafter), num_draft_tokens=DEPTH)
    try:
        runs = {bs: generate_greedy(llm, prompt_ids, MAX_TOKENS, bs) for bs in BATCH_SIZES}
    finally:
        del llm
        release_vllm()
    return runs


@pytest.fixture(scope="session")
def prompt_ids(smollm2_path) -> list[list[int]]:
    """The four prompts after the target's chat template, as our engine encodes them."""
    if not HAVE_VLLM:
        pytest.skip(NO_VLLM)
    from slimspec_convert.engines.vllm.bench import encode_texts

    return encode_texts(str(smollm2_path), list(PROMPTS))


@pytest.fixture(scope="session")
def plain(smollm2_path, prompt_ids) -> dict:
    """Plain greedy decoding in vLLM: batch size -> :class:`GreedyRun`."""
    return run_drafter(smollm2_path, None, prompt_ids)


@pytest.fixture(scope="session")
def demo_lowrank(smollm2_path, tmp_path_factory) -> Path:
    """`slimspec convert drafters/smollm2-135m-eagle3 OUT --rank 72 --target T` (calibrated)."""
    from slimspec_convert.workflows.convert import ConvertConfig, convert

    out = tmp_path_factory.mktemp("vllm") / "demo-r72"
    convert(DEMO, out, ConvertConfig(rank=72, target=str(smollm2_path)))
    return out
