"""Converted drafters in vLLM's offline ``LLM`` on the real target: lossless at batch 1 and 4, vLLM's
mean acceptance length within 5% of our engine's tau on the same prompts and chain depth, and no
dense head built for a low-rank drafter. The drafters: the committed demo drafter converted, and two
drafters as other tools save them (SpecForge at full vocabulary with an all-zero ``d2t``; 16k-trimmed
with ``d2t``), each converted, plus the SpecForge one made loadable by stock vLLM with ``fix-vllm``."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import BATCH_SIZES, DEMO, DEPTH, HAVE_VLLM, MAX_TOKENS, NO_VLLM, run_drafter

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM),
]

VOCAB, HIDDEN, RANK = 49152, 576, 72


def _ours_tau(target, drafter, prompt_ids) -> tuple[list[list[int]], float]:
    from slimspec_convert.engines.vllm.bench import ours_greedy

    return ours_greedy(str(target), str(drafter), prompt_ids, DEPTH, MAX_TOKENS)


def _check_lossless_and_tau(runs, plain, ours_outputs, ours_tau) -> None:
    for bs in BATCH_SIZES:
        assert runs[bs].output_ids == plain[bs].output_ids, f"batch {bs}"
    assert ours_outputs == plain[1].output_ids  # our engine, greedy: the same tokens
    counters = runs[1].counters
    assert counters.num_drafts > 0 and counters.num_draft_tokens == DEPTH * counters.num_drafts
    assert counters.mean_acceptance_length == pytest.approx(ours_tau, rel=0.05)


@pytest.fixture(scope="module")
def demo_runs(smollm2_path, demo_lowrank, prompt_ids):
    """The converted demo drafter in vLLM, every ParallelLMHead built while it loads recorded."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    built = []
    original = vpe.ParallelLMHead.__init__

    def record(self, num_embeddings, embedding_dim, *args, **kwargs):
        built.append((kwargs.get("prefix", ""), num_embeddings, embedding_dim))
        original(self, num_embeddings, embedding_dim, *args, **kwargs)

    vpe.ParallelLMHead.__init__ = record
    try:
        runs = run_drafter(smollm2_path, demo_lowrank, prompt_ids)
    finally:
        vpe.ParallelLMHead.__init__ = original
    return runs, built


def test_plain_vllm_equals_our_plain_greedy(smollm2_path, plain, prompt_ids):
    from slimspec_convert.engines.vllm.bench import ours_greedy

    outputs, tau = ours_greedy(str(smollm2_path), None, prompt_ids, DEPTH, MAX_TOKENS)
    assert tau is None
    assert outputs == plain[1].output_ids


def test_converted_demo_drafter_is_lossless_and_accepts_as_in_our_engine(
    smollm2_path, demo_lowrank, demo_runs, plain, prompt_ids
):
    runs, _ = demo_runs
    _check_lossless_and_tau(runs, plain, *_ours_tau(smollm2_path, demo_lowrank, prompt_ids))


def test_no_dense_head_is_built_for_the_lowrank_drafter(demo_runs):
    """The only V x d head vLLM builds is the target's; the drafter's is W_up, V x r (r = 72)."""
    _, built = demo_runs
    dense = [b for b in built if b[1:] == (VOCAB, HIDDEN)]
    assert [b[1:] for b in built] == [(VOCAB, HIDDEN), (VOCAB, RANK)], built
    assert len(dense) == 1 and not dense[0][0].startswith("draft")
    assert built[1][0].endswith("lm_head.up")


@pytest.fixture(scope="module")
def specforge_full(smollm2_path, tmp_path_factory):
    """The demo drafter as SpecForge saves a full-vocabulary drafter: its head stored, and an all-zero
    d2t with t2d (the format quirk stock vLLM refuses)."""
    import torch
    from safetensors.torch import load_file, save_file

    from slimspec_convert.checkpoint.load import load_drafter
    from slimspec_convert.checkpoint.save import save_drafter

    drafter, _ = load_drafter(DEMO, smollm2_path)
    folder = save_drafter(drafter, tmp_path_factory.mktemp("sf") / "sf-full", dtype=torch.bfloat16)
    state = load_file(folder / "model.safetensors")
    state |= {"d2t": torch.zeros(VOCAB, dtype=torch.int64), "t2d": torch.ones(VOCAB, dtype=torch.bool)}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_specforge_zero_d2t_is_refused_by_stock_vllm_and_fixed_by_fix_vllm(
    smollm2_path, specforge_full, plain, prompt_ids, tmp_path
):
    from slimspec_convert.engines.vllm.run import make_llm, release_vllm
    from slimspec_convert.workflows.fix_vllm import fix_vllm

    with pytest.raises(Exception, match="no module or parameter named 'draft_id_to_target_id'"):
        make_llm(str(smollm2_path), str(specforge_full), num_draft_tokens=DEPTH)
    release_vllm()
    fixed = tmp_path / "fixed"
    assert fix_vllm(specforge_full, fixed).dropped == ("d2t", "t2d")
    runs = run_drafter(smollm2_path, fixed, prompt_ids)
    _check_lossless_and_tau(runs, plain, *_ours_tau(smollm2_path, fixed, prompt_ids))


def test_converted_specforge_full_vocab_drafter_loads_with_the_plugin(
    smollm2_path, specforge_full, plain, prompt_ids, tmp_path
):
    from slimspec_convert.workflows.convert import ConvertConfig, convert

    out = tmp_path / "sf-r72"
    convert(specforge_full, out, ConvertConfig(rank=RANK, target=str(smollm2_path), calibration_samples=16))
    runs = run_drafter(smollm2_path, out, prompt_ids)
    _check_lossless_and_tau(runs, plain, *_ours_tau(smollm2_path, out, prompt_ids))


def test_converted_16k_trimmed_drafter_loads_with_the_plugin(smollm2_path, plain, prompt_ids, tmp_path):
    """`slimspec trim` to 16,384 tokens (d2t), then `slimspec convert`: a low-rank head over a trimmed
    vocabulary, mapped to target ids through vLLM's draft_id_to_target_id."""
    from safetensors import safe_open

    from slimspec_convert.workflows.convert import ConvertConfig, convert
    from slimspec_convert.workflows.trim import TrimConfig, trim_checkpoint
    from tests.vllm.conftest import REPO

    data = (str(REPO / "data" / "train" / "gsm8k" / "train.jsonl"),)
    trim_checkpoint(DEMO, tmp_path / "trim16k", TrimConfig(16384, data, str(smollm2_path)))
    out = tmp_path / "trim16k-r72"
    convert(
        tmp_path / "trim16k", out, ConvertConfig(rank=RANK, target=str(smollm2_path), calibration_samples=16)
    )
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("lm_head.up.weight").get_shape() == [16384, RANK]
        assert int(f.get_tensor("d2t").count_nonzero()) > 0  # a real remapping, not the identity
    runs = run_drafter(smollm2_path, out, prompt_ids)
    _check_lossless_and_tau(runs, plain, *_ours_tau(smollm2_path, out, prompt_ids))
