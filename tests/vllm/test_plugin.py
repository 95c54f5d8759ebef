"""The plugin without a model run: lazy registration through vLLM's entry point, the vocabulary
sharding arithmetic of the low-rank head at tensor-parallel size 2 (two ranks emulated on the CPU),
and vLLM's own error for a low-rank folder when the plugin is not loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.vllm.conftest import HAVE_VLLM, NO_VLLM

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)]


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=600
    )


def test_entry_point_registers_the_architecture_by_name_only():
    """vLLM's plugin loader finds the hook; registering imports neither the model class nor vLLM's
    EAGLE-3 model code (vLLM imports them when a drafter names the architecture)."""
    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm import ModelRegistry\n"
        "print('SlimSpecLlamaForCausalLMEagle3' in ModelRegistry.get_supported_archs())\n"
        "print('slimspec_convert.engines.vllm.model' in sys.modules)\n"
        "print('vllm.model_executor.models.llama_eagle3' in sys.modules)\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False", "False"]


def test_vocab_sharded_up_projection_matches_the_full_head_at_tp2(monkeypatch):
    """W_up split over the vocabulary as vLLM's ParallelLMHead splits it (its own shard indices and
    weight loader), each rank's logits and local argmax computed, then gathered the way
    LogitsProcessor gathers: the logits equal up(down(h)) and the top tokens equal its argmax."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers import logits_processor as lp

    from slimspec_convert.engines.vllm.model import LowRankParallelLMHead

    V, d, r, tp = 1000, 32, 8, 2  # 1000 is not a multiple of 64: shards carry padding rows
    g = torch.Generator().manual_seed(0)
    W_down, W_up = torch.randn(r, d, generator=g), torch.randn(V, r, generator=g)
    h = torch.randn(16, d, generator=g)
    want_logits = h @ W_down.T @ W_up.T  # [16, V]

    ranks = []
    with set_current_vllm_config(VllmConfig()):
        for rank in range(tp):
            group = SimpleNamespace(rank_in_group=rank, world_size=tp)  # what vLLM's layers ask the TP group
            monkeypatch.setattr(parallel_state, "get_tp_group", lambda group=group: group)
            head = LowRankParallelLMHead(d, V, r, prefix="lm_head")
            head.down.weight.data.copy_(W_down)
            head.up.weight_loader(head.up.weight, W_up)
            for module in (head.down, head.up):  # as vLLM's loader does after loading (CPU kernels)
                module.quant_method.process_weights_after_loading(module)
            ranks.append(head)
        processor = lp.LogitsProcessor(V)
    assert [h_.up.weight.shape[0] for h_ in ranks] == [512, 512]  # pad_vocab_size(1000) = 1024, halved
    local = [p._apply_head(head.up, head(h), None) for p, head in ((processor, x) for x in ranks)]
    monkeypatch.setattr(lp, "tensor_model_parallel_gather", lambda t: torch.cat(local, dim=-1))
    monkeypatch.setattr(lp, "tensor_model_parallel_all_gather", lambda t: torch.cat(local, dim=-1))
    got = processor._get_logits(ranks[0](h), ranks[0].up, None)
    assert got.shape == (16, V)
    assert torch.allclose(got, want_logits, atol=1e-4)

    gathered = []  # each rank's (value, global index) pairs, as get_top_tokens all-gathers them

    def record(t, dim=-1):
        gathered.append(t)
        return torch.cat([t] * tp, dim)  # shape-valid stand-in; this pass only records

    monkeypatch.setattr(lp, "tensor_model_parallel_all_gather", record)
    for head in ranks:
        processor.get_top_tokens(head.up, head(h))
    monkeypatch.setattr(lp, "tensor_model_parallel_all_gather", lambda t, dim=-1: torch.cat(gathered, dim))
    tops = [processor.get_top_tokens(head.up, head(h)).tolist() for head in ranks]
    want = want_logits.argmax(-1).tolist()
    assert tops == [want, want]
    assert {t >= 512 for t in want} == {False, True}  # winners on both ranks' shards (ids 0-511, 512-999)


def test_without_the_plugin_vllm_refuses_the_lowrank_folder_with_its_own_error(smollm2_path, demo_lowrank):
    """VLLM_PLUGINS names the plugins vLLM may load; with none, the architecture is unknown."""
    code = (
        "from slimspec_convert.engines.vllm.run import make_llm\n"
        f"make_llm({str(smollm2_path)!r}, {str(demo_lowrank)!r})\n"
    )
    done = _python(code, VLLM_PLUGINS="")
    assert done.returncode != 0
    assert "SlimSpecLlamaForCausalLMEagle3" in done.stderr
    assert "are not supported for now" in done.stderr, done.stderr[-3000:]
