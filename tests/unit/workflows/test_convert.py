"""``convert``, ``slimspec convert`` and ``slimspec inspect``: output, report values, vocab maps, bad input.

Reference values: Eckart-Young errors from ``torch.linalg.svdvals`` of the source head, and
``||W - W_up W_down||_F`` measured directly on the factors read back with the safetensors library.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from slimspec_convert.atomic import staged_folder
from slimspec_convert.checkpoint.load import load_drafter, load_native
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.checkpoint.weightfiles import CheckpointError
from slimspec_convert.cli.app import app
from slimspec_convert.model.vocab import draft_to_target_ids, scatter_to_target_vocab
from slimspec_convert.workflows.convert import ConvertConfig, convert
from tests.helpers.eagle3_layouts import save_tiny_target, write_layout
from tests.helpers.models import read_tensors, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = tiny_target()
    return model, save_tiny_target(model, tmp_path_factory.mktemp("target"))


@pytest.fixture
def source(target, tmp_path):
    """A trimmed (V_d = 64 of 128) SpecForge-layout drafter whose embedding is the target's."""
    drafter = tiny_drafter(draft_vocab_size=64)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target[0].get_input_embeddings().weight)
    return drafter, write_layout(drafter, "specforge", tmp_path / "src")


def _eckart_young(W, r):
    s = torch.linalg.svdvals(W.to(torch.float64))
    return float((s[r:] ** 2).sum().sqrt() / (s**2).sum().sqrt())


def _measured(W, W_up, W_down):
    W = W.to(torch.float64)
    return float(torch.linalg.norm(W - W_up.double() @ W_down.double()) / torch.linalg.norm(W))


def test_convert_output_report_and_error(source, tmp_path):
    drafter, src = source
    W = drafter.lm_head.weight.detach()
    report = convert(src, tmp_path / "out", ConvertConfig(rank=8))
    out = read_tensors(tmp_path / "out")
    assert "lm_head.weight" not in out
    assert out["lm_head.down.weight"].shape == (8, 32) and out["lm_head.up.weight"].shape == (64, 8)
    bound = _eckart_young(W, 8)
    assert report.relative_error == pytest.approx(bound, rel=1e-4)
    assert _measured(W, out["lm_head.up.weight"], out["lm_head.down.weight"]) == pytest.approx(
        bound, rel=1e-4
    )
    assert report.energy_retained == pytest.approx(1 - bound**2, rel=1e-6)
    saved = json.loads((tmp_path / "out" / "slimspec_report.json").read_text())
    assert {
        k: saved[k]
        for k in ("source_format", "rank", "hidden_size", "vocab_size", "params_before", "params_after")
    } == {
        "source_format": "specforge",
        "rank": 8,
        "hidden_size": 32,
        "vocab_size": 64,
        "params_before": 64 * 32,
        "params_after": 8 * (32 + 64),
    }
    assert saved["relative_error"] == pytest.approx(bound, rel=1e-4) and saved["seconds"] > 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["lm_head_rank"] == 8 and config["lm_head_rank_divisor"] == 4  # TorchSpec: r = d // divisor
    assert config["slimspec"]["drafter_config"]["head_rank"] == 8
    for key in ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight"):  # body copied unchanged
        assert torch.equal(out[key], drafter.state_dict()[key])
    assert "8 (--rank 8)" in report.summary() and f"{bound:.6f}" in report.summary()


def test_vocab_maps_byte_identical_and_rows_keep_their_tokens(source, target, tmp_path):
    drafter, src = source
    convert(src, tmp_path / "out", ConvertConfig(rank=32))  # full rank: the converted head equals W
    before, after = load_file(str(src / "model.safetensors")), read_tensors(tmp_path / "out")
    for key in ("d2t", "t2d"):
        assert after[key].dtype == before[key].dtype
        assert after[key].numpy().tobytes() == before[key].numpy().tobytes()
    converted, report = load_drafter(tmp_path / "out", target[1])
    assert report.source_format == "slimspec" and converted.config.head_rank == 32
    h = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense, low = drafter.logits(h), converted.logits(h)
    assert torch.allclose(low, dense, atol=1e-5)
    full = scatter_to_target_vocab(low, converted.d2t, 128)  # row i scores target token i + d2t[i]
    ids = draft_to_target_ids(drafter.d2t)
    assert torch.equal(full[:, ids], low) and torch.isinf(full[:, ~drafter.t2d]).all()
    assert torch.equal(converted.to_target_ids(low.argmax(-1)), ids[dense.argmax(-1)])


def test_rank_rules_dtype_and_randomized(source, tmp_path):
    drafter, src = source
    W = drafter.lm_head.weight.detach()
    assert convert(src, tmp_path / "a", ConvertConfig()).rank == 4  # default d/8
    assert convert(src, tmp_path / "b", ConvertConfig(rank_fraction=0.25)).rank == 8
    s = torch.linalg.svdvals(W.double())
    want = int(((torch.cumsum(s**2, 0) / (s**2).sum()) < 0.9).sum()) + 1  # smallest r with >= 90 % energy
    rep = convert(src, tmp_path / "c", ConvertConfig(energy=0.9))
    assert rep.rank == want and rep.energy_retained >= 0.9 and rep.svd_method == "exact"
    rep = convert(src, tmp_path / "d", ConvertConfig(rank=8, dtype="bf16"))
    out = read_tensors(tmp_path / "d")
    assert out["lm_head.up.weight"].dtype == torch.bfloat16 and out["fc.weight"].dtype == torch.float32
    rep = convert(src, tmp_path / "e", ConvertConfig(rank=4, svd="randomized", svd_niter=2))
    out = read_tensors(tmp_path / "e")
    measured = _measured(W, out["lm_head.up.weight"], out["lm_head.down.weight"])
    assert rep.svd_method == "randomized" and rep.relative_error == pytest.approx(measured, rel=1e-4)
    assert _eckart_young(W, 4) <= measured <= _eckart_young(W, 4) * 1.005


def test_full_vocab_head(source, target, tmp_path):
    drafter, src = source
    cfg = ConvertConfig(rank=32, target=str(target[1]), full_vocab=True, calibrate=False)  # the plain SVD
    rep = convert(src, tmp_path / "out", cfg)
    assert (rep.vocab_size, rep.target_rows_added, rep.full_vocab) == (128, 64, True)
    out = read_tensors(tmp_path / "out")
    assert "d2t" not in out and "t2d" not in out and out["lm_head.up.weight"].shape == (128, 32)
    head = out["lm_head.up.weight"] @ out["lm_head.down.weight"]  # full rank: the assembled head itself
    ids = draft_to_target_ids(drafter.d2t)
    assert torch.allclose(head[ids], drafter.lm_head.weight, atol=1e-5)
    target_head = target[0].get_output_embeddings().weight
    assert torch.allclose(head[~drafter.t2d], target_head[~drafter.t2d], atol=1e-5)
    converted, _ = load_drafter(tmp_path / "out", target[1])
    assert converted.d2t is None and converted.config.draft_vocab_size == 128


def test_full_vocab_refuses_a_target_of_another_width(source, tmp_path):
    _, src = source
    other = save_tiny_target(tiny_target(hidden_size=48), tmp_path / "wide")
    with pytest.raises(ValueError, match=r"has hidden size 48 but the drafter has d=32"):
        convert(src, tmp_path / "out", ConvertConfig(target=str(other), full_vocab=True))
    assert not (tmp_path / "out").exists()


def _nothing_written(tmp_path, name="out"):
    assert not (tmp_path / name).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{name}.")]  # no temp folder left


def test_bad_input_writes_nothing(source, tmp_path):
    _, src = source
    with pytest.raises(ValueError, match=r"rank r=0 must be >= 1"):
        ConvertConfig(rank=0)
    with pytest.raises(ValueError, match=r"rank r=33 is outside \[1, min\(V_d, d\)\] = \[1, 32\]"):
        convert(src, tmp_path / "out", ConvertConfig(rank=33))
    _nothing_written(tmp_path)
    state = load_file(str(src / "model.safetensors"))
    state["lm_head.weight"][1, 1] = float("inf")
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: 'lm_head\.weight' has 1 NaN/inf entries"):
        convert(src, tmp_path / "out", ConvertConfig(rank=4))
    _nothing_written(tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-64])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor .* the file is truncated"):
        convert(src, tmp_path / "out", ConvertConfig(rank=4))
    _nothing_written(tmp_path)


def test_existing_out_needs_force(source, tmp_path):
    _, src = source
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"out: already exists; pass --force"):
        convert(src, tmp_path / "out", ConvertConfig(rank=4))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    convert(src, tmp_path / "out", ConvertConfig(rank=4, force=True))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
        "slimspec_report.json",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(ValueError, match="already low-rank"):
        convert(tmp_path / "out", tmp_path / "again", ConvertConfig(rank=2))


def test_converted_folder_loads_natively_and_all_layouts_convert_alike(source, target, tmp_path):
    drafter, src = source
    reports = {}
    for layout in ("eagle", "modelopt", "vllm", "speculators"):
        folder = write_layout(drafter, layout, tmp_path / layout)
        reports[layout] = convert(folder, tmp_path / f"{layout}-out", ConvertConfig(rank=8))
        out = read_tensors(tmp_path / f"{layout}-out")
        ref = read_tensors(tmp_path / "eagle-out")
        for key in (
            "lm_head.up.weight",
            "lm_head.down.weight",
            "d2t",
            "t2d",
            "midlayer.self_attn.k_proj.weight",
        ):
            assert torch.equal(out[key], ref[key]), (layout, key)
    assert {r.source_format for r in reports.values()} == {"eagle", "modelopt", "vllm", "speculators"}
    assert reports["vllm"].vocab_maps == "rebuilt t2d from d2t, d2t copied"
    native = load_native(tmp_path / "vllm-out", embed_from=target[0].get_input_embeddings().weight)
    assert native.config.head_rank == 8


# ---- CLI --------------------------------------------------------------------------------------


def test_cli_convert_and_inspect(source, tmp_path):
    _, src = source
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", str(src), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["source_format"] == "specforge" and info["config"]["draft_vocab_size"] == 64
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--rank", "8"])
    assert result.exit_code == 0, result.output
    assert "relative_error" in result.output and "specforge" in result.output
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--rank", "4", "--json"])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "already exists; pass --force" in result.output
    assert json.loads((tmp_path / "out" / "slimspec_report.json").read_text())["rank"] == 8  # untouched


@pytest.mark.parametrize(
    "args,match",
    [
        (["--rank", "0"], "rank r=0 must be >= 1"),
        (["--rank", "40"], "rank r=40 is outside"),
        (["--rank", "4", "--energy", "0.9"], "give only one of rank, rank_fraction, energy"),
        (["--full-vocab"], "full_vocab needs target"),
        (["--dtype", "int8"], "ConvertConfig.dtype='int8'"),
        (["--calibration-damp", "0"], "ConvertConfig.calibration_damp=0.0: expected > 0"),
        (["--calibration-data", "train.jsonl"], "--calibration-data needs --target"),
    ],
)
def test_cli_bad_options_exit_2_and_write_nothing(source, tmp_path, args, match):
    _, src = source
    result = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and match in result.output
    assert result.output.startswith("error: ") and result.output.strip().count("\n") == 0
    _nothing_written(tmp_path)


def test_cli_bad_checkpoint_exit_2(source, tmp_path):
    _, src = source
    config = json.loads((src / "config.json").read_text())
    del config["num_attention_heads"]
    (src / "config.json").write_text(json.dumps(config))
    runner = CliRunner()
    for cmd in (["convert", str(src), str(tmp_path / "out")], ["inspect", str(src)]):
        result = runner.invoke(app, cmd)
        assert result.exit_code == 2
        assert "config.json: missing field 'num_attention_heads'" in result.output
    _nothing_written(tmp_path)


# ---- the rerank's precondition: was the dense head the embedding? ---------------------------------


def _tied(target_model, tie: bool = True):
    """An untrimmed drafter whose embedding is the target's and whose head is that table (or random)."""
    drafter = tiny_drafter(seed=5)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        if tie:
            drafter.lm_head.weight.copy_(drafter.embed_tokens.weight)
    return drafter


def test_convert_records_whether_the_head_was_the_embedding_and_rerank_follows_it(target, tmp_path):
    model, tpath = target
    tied = write_layout(_tied(model), "specforge", tmp_path / "tied", with_embed=True)
    rep = convert(tied, tmp_path / "tied-r4", ConvertConfig(rank=4))
    assert rep.head_is_embedding is True and "yes (--rerank serves it)" in rep.summary()
    config = json.loads((tmp_path / "tied-r4" / "config.json").read_text())["slimspec"]
    assert config["drafter_config"]["head_is_embedding"] is True and config["conversion"]["head_is_embedding"]
    low, _ = load_drafter(tmp_path / "tied-r4")
    low.eval().enable_rerank(128)  # k = V: every row rescored exactly, so the dense tied head comes back
    h = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(low.lm_head(h), h @ model.get_input_embeddings().weight.T, atol=1e-5)
    save_drafter(low, tmp_path / "tuned")  # what finetune writes: the record travels with the config
    assert load_drafter(tmp_path / "tuned", tpath)[0].config.head_is_embedding is True

    untied = write_layout(_tied(model, tie=False), "specforge", tmp_path / "untied", with_embed=True)
    assert convert(untied, tmp_path / "untied-r4", ConvertConfig(rank=4)).head_is_embedding is False
    with pytest.raises(ValueError, match=r"not the embedding table \(head_is_embedding = false"):
        load_drafter(tmp_path / "untied-r4")[0].enable_rerank(8)

    no_embed = write_layout(_tied(model), "specforge", tmp_path / "no-embed")  # embed_tokens not in the file
    rep = convert(no_embed, tmp_path / "unknown", ConvertConfig(rank=4))
    assert rep.head_is_embedding is None and "unknown (no --target)" in rep.summary()
    with pytest.raises(ValueError, match=r"head_is_embedding unset.*slimspec convert SRC OUT --target T"):
        load_drafter(tmp_path / "unknown", tpath)[0].enable_rerank(8)
    with_target = ConvertConfig(rank=4, target=str(tpath), calibrate=False)  # the target lends its embedding
    assert convert(no_embed, tmp_path / "known", with_target).head_is_embedding is True


# ---- output modes follow the umask, as cp and save_pretrained ---------------------------------------


@pytest.mark.parametrize("umask,dir_mode,file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_outputs_follow_the_umask(source, tmp_path, umask, dir_mode, file_mode):
    """mkstemp/mkdtemp alone would give 0600/0700 whatever the umask; atomic.py widens them."""
    import os
    import stat

    drafter, src = source
    old = os.umask(umask)
    try:
        convert(src, tmp_path / "out", ConvertConfig(rank=4))
        save_drafter(drafter, tmp_path / "saved")  # finetune / trim write through this
        with staged_folder(
            tmp_path / "cached"
        ) as build:  # fetch-smollm2: save_pretrained writes 0600 weights
            tiny_target().save_pretrained(build)
    finally:
        os.umask(old)
    for folder in (tmp_path / "out", tmp_path / "saved", tmp_path / "cached"):
        assert stat.S_IMODE(folder.stat().st_mode) == dir_mode, folder
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        assert modes and set(modes.values()) == {file_mode}, modes
