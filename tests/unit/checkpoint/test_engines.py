"""Which engines load a folder (``slimspec inspect``), from the rules of vLLM 0.32's EAGLE-3 loader
(``vllm/model_executor/models/llama_eagle3.py``); the vLLM tier (tests/vllm) checks them in vLLM."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from slimspec_convert.checkpoint.engines import ENGINES, engine_support
from slimspec_convert.checkpoint.load import inspect_drafter
from slimspec_convert.checkpoint.names import DENSE_ARCHITECTURE, LOWRANK_ARCHITECTURE
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.cli import app
from tests.helpers.eagle3_layouts import write_layout
from tests.helpers.models import tiny_drafter


def _support(folder) -> dict[str, tuple[bool, str]]:
    return {e.engine: (e.loads, e.why) for e in engine_support(folder, inspect_drafter(folder))}


def _arch(folder) -> str:
    return json.loads((folder / "config.json").read_text())["architectures"][0]


def test_lowrank_folder_names_the_plugin_architecture_and_only_the_plugin_loads_it(tmp_path):
    folder = save_drafter(tiny_drafter(head_rank=8), tmp_path / "lr")
    assert _arch(folder) == LOWRANK_ARCHITECTURE == "SlimSpecLlamaForCausalLMEagle3"
    got = _support(folder)
    assert list(got) == list(ENGINES)
    assert [got[e][0] for e in ENGINES] == [True, True, True, False]
    assert got["vllm+plugin"][1] == "SlimSpecLlamaForCausalLMEagle3: low-rank head, r=8"
    assert got["vllm"][1] == "SlimSpecLlamaForCausalLMEagle3 is registered only by the slimspec plugin"


def test_dense_folder_keeps_the_stock_architecture_and_stock_vllm_loads_it(tmp_path):
    folder = save_drafter(tiny_drafter(), tmp_path / "dense", include_head=False)
    assert _arch(folder) == DENSE_ARCHITECTURE == "LlamaForCausalLMEagle3"
    got = _support(folder)
    want = "LlamaForCausalLMEagle3: Eagle3LlamaForCausalLM, borrows the target's lm_head"
    assert got["vllm"] == (True, want)
    assert got["vllm+plugin"] == got["vllm"]
    assert got["slimspec"] == (
        True,
        "load_drafter reads the slimspec layout (borrows embed_tokens.weight, lm_head.weight from the "
        "target)",
    )


def test_trimmed_folder_with_d2t_loads_in_stock_vllm(tmp_path):
    folder = write_layout(tiny_drafter(draft_vocab_size=64), "specforge", tmp_path / "trim")
    assert _support(folder)["vllm"] == (True, "LlamaForCausalLMEagle3: Eagle3LlamaForCausalLM, dense lm_head")


def test_full_vocab_with_zero_d2t_is_refused_for_vllm_and_names_the_fix(tmp_path):
    folder = write_layout(tiny_drafter(), "specforge", tmp_path / "sf")
    state = load_file(folder / "model.safetensors")
    state |= {"d2t": torch.zeros(128, dtype=torch.int64), "t2d": torch.ones(128, dtype=torch.bool)}
    save_file(state, str(folder / "model.safetensors"))
    loads, why = _support(folder)["vllm"]
    assert not loads
    assert why == (
        "'d2t' at full vocabulary (draft_vocab_size == vocab_size == 128): vLLM has no parameter for it; "
        "`slimspec fix-vllm SRC OUT` drops it"
    )


def test_lowrank_head_under_the_dense_architecture_is_refused_for_vllm(tmp_path):
    folder = write_layout(tiny_drafter(head_rank=8), "torchspec", tmp_path / "ts")
    got = _support(folder)
    assert got["slimspec"][0] and not got["vllm+plugin"][0] and not got["vllm"][0]
    assert got["vllm"][1] == (
        "low-rank head under architectures[0]='LlamaForCausalLMEagle3': vLLM would build a dense head; "
        "`slimspec fix-vllm SRC OUT` names the plugin's architecture"
    )


def test_inspect_prints_one_line_per_engine(tmp_path):
    folder = save_drafter(tiny_drafter(head_rank=8), tmp_path / "lr")
    result = CliRunner().invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("engine ")]
    ours = "load_drafter reads the slimspec layout (borrows embed_tokens.weight from the target)"
    assert lines == [
        f"engine slimspec      loads: {ours}",
        f"engine transformers  loads: {ours}",
        "engine vllm+plugin   loads: SlimSpecLlamaForCausalLMEagle3: low-rank head, r=8",
        "engine vllm          no: SlimSpecLlamaForCausalLMEagle3 is registered only by the slimspec plugin",
    ]
    as_json = json.loads(CliRunner().invoke(app, ["inspect", str(folder), "--json"]).stdout)
    assert [(e["engine"], e["loads"]) for e in as_json["engines"]] == [
        ("slimspec", True),
        ("transformers", True),
        ("vllm+plugin", True),
        ("vllm", False),
    ]
