"""``slimspec fix-vllm``: an identity ``d2t`` at full vocabulary is dropped, everything else copied as is."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from slimspec_convert.checkpoint.engines import engine_support
from slimspec_convert.checkpoint.load import inspect_drafter
from slimspec_convert.cli import app
from slimspec_convert.workflows.fix_vllm import fix_vllm
from tests.helpers.eagle3_layouts import write_layout
from tests.helpers.models import tiny_drafter


def _specforge_with_d2t(folder, d2t):
    write_layout(tiny_drafter(), "specforge", folder)
    (folder / "README.md").write_text("card")
    state = load_file(folder / "model.safetensors")
    state |= {"d2t": d2t, "t2d": torch.ones(128, dtype=torch.bool)}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def test_fix_drops_the_identity_d2t_and_copies_the_rest_byte_for_byte(tmp_path):
    src = _specforge_with_d2t(tmp_path / "src", torch.zeros(128, dtype=torch.int64))
    report = fix_vllm(src, tmp_path / "out")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(before.keys() - after.keys()) == ["d2t", "t2d"]  # something changed
    assert all(torch.equal(after[k], before[k]) and after[k].dtype == before[k].dtype for k in after)
    assert (report.dropped, report.architecture, report.num_tensors) == (("d2t", "t2d"), None, len(after))
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert (tmp_path / "out" / "README.md").read_text() == "card"
    support = {e.engine: e.loads for e in engine_support(tmp_path / "out", inspect_drafter(tmp_path / "out"))}
    assert support["vllm"] is True


def test_fix_refuses_a_permutation_a_trimmed_vocab_and_a_folder_without_d2t(tmp_path):
    perm = _specforge_with_d2t(tmp_path / "perm", torch.tensor([1, -1] + [0] * 126))
    with pytest.raises(ValueError, match="'d2t' is not all zero at full vocabulary"):
        fix_vllm(perm, tmp_path / "o1")
    trimmed = write_layout(tiny_drafter(draft_vocab_size=64), "specforge", tmp_path / "trim")
    with pytest.raises(ValueError, match="draft_vocab_size=64 != vocab_size=128: a trimmed vocabulary, vLLM"):
        fix_vllm(trimmed, tmp_path / "o2")
    plain = write_layout(tiny_drafter(), "specforge", tmp_path / "plain")
    with pytest.raises(ValueError, match="no 'd2t' in the weight files; nothing to fix for vLLM"):
        fix_vllm(plain, tmp_path / "o3")
    assert not any((tmp_path / n).exists() for n in ("o1", "o2", "o3"))


def test_cli_fix_vllm_exits_2_with_one_line(tmp_path):
    plain = write_layout(tiny_drafter(), "specforge", tmp_path / "plain")
    result = CliRunner().invoke(app, ["fix-vllm", str(plain), str(tmp_path / "o")])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {plain}: no 'd2t' in the weight files; nothing to fix for vLLM"


def test_fix_names_the_plugin_architecture_for_a_misnamed_lowrank_head(tmp_path):
    """A TorchSpec low-rank folder (LlamaForCausalLMEagle3, lm_head.down/up): config.json gets the
    plugin's architecture and lm_head_rank; the tensors are copied unchanged; a second run refuses."""
    import json

    src = write_layout(tiny_drafter(head_rank=8), "torchspec", tmp_path / "ts")
    report = fix_vllm(src, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["lm_head_rank"]) == (["SlimSpecLlamaForCausalLMEagle3"], 8)
    assert (report.dropped, report.architecture) == ((), "SlimSpecLlamaForCausalLMEagle3")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    support = {e.engine: e.loads for e in engine_support(tmp_path / "out", inspect_drafter(tmp_path / "out"))}
    assert (support["vllm+plugin"], support["vllm"]) == (True, False)
    with pytest.raises(
        ValueError, match="architectures\\[0\\] is already SlimSpecLlamaForCausalLMEagle3; nothing"
    ):
        fix_vllm(tmp_path / "out", tmp_path / "again")
