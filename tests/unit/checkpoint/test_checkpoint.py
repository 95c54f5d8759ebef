"""Universal loader: every published layout of the same weights gives identical logits; bad files are refused.

Layouts are written by tests/helpers/eagle3_layouts.py with the upstream key names and config fields;
the reference is the in-memory drafter itself (an independent path: no file involved).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from slimspec_convert.checkpoint.load import inspect_drafter, load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.checkpoint.weightfiles import (
    CheckpointError,
    read_safetensors_header,
    write_safetensors,
)
from slimspec_convert.model.drafter import Eagle3Drafter
from tests.helpers.eagle3_layouts import LAYOUTS, canonical_state, save_tiny_target, write_layout
from tests.helpers.models import tiny_drafter, tiny_target

FORMAT_OF = {
    "eagle": "eagle",
    "specforge": "specforge",
    "specforge_sharded": "specforge",
    "speculators": "speculators",
    "modelopt": "modelopt",
    "vllm": "vllm",
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(model, folder) of the tiny 6-layer target (V=128, d=32)."""
    model = tiny_target()
    return model, save_tiny_target(model, tmp_path_factory.mktemp("target"))


def _drafter(target, **overrides):
    drafter = tiny_drafter(**overrides)
    with torch.no_grad():  # trainers freeze the embedding to the target's (eagle3-formats.md section 5)
        drafter.embed_tokens.weight.copy_(target[0].get_input_embeddings().weight)
    return drafter


def _logits(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, drafter.config.vocab_size, (2, 5), generator=g)
    aux = torch.randn(2, 5, drafter.fc.in_features, generator=g)
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        return drafter.logits(drafter(ids, drafter.fuse(aux), pos))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_identical_logits(layout, target, tmp_path):
    drafter = _drafter(target, draft_vocab_size=64)
    folder = write_layout(drafter, layout, tmp_path / layout)
    loaded, report = load_drafter(folder, target[1])
    assert report.source_format == FORMAT_OF[layout]
    assert torch.equal(_logits(loaded), _logits(drafter))
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    assert report.borrowed == ([] if layout == "speculators" else ["embed_tokens.weight"])
    assert report.rebuilt == (["t2d"] if layout in ("modelopt", "vllm") else [])
    assert loaded.config.aux_layer_ids == (None if layout == "eagle" else (2, 3, 4))  # EAGLE hard-codes them
    assert report.aux_layer_ids_convention == (
        "output_of_layer"
        if layout in ("specforge", "specforge_sharded", "modelopt")
        else None
        if layout == "eagle"
        else "boundary"
    )
    if layout == "vllm":
        assert report.tensors["midlayer.self_attn.k_proj.weight"].endswith(
            "'model.layers.0.self_attn.qkv_proj.weight' rows [32:48]"
        )


@pytest.mark.parametrize(
    "overrides,layouts,reset",
    [
        (
            dict(
                head_dim=16,
                rope_theta=500000.0,
                num_hidden_layers=2,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            ("eagle", "speculators", "modelopt", "vllm"),
            dict(rope_theta=10000.0, rope_scaling=None),
        ),
        (
            dict(norm_before_fc=True, norm_before_residual=True),
            ("specforge", "speculators", "vllm"),
            dict(norm_before_residual=False),
        ),
        (dict(fc_norm=True), ("specforge", "speculators"), None),
    ],
)
def test_flag_variants_identical_logits(overrides, layouts, reset, target, tmp_path):
    drafter = _drafter(target, draft_vocab_size=64, **overrides)
    for layout in layouts:
        loaded, _ = load_drafter(write_layout(drafter, layout, tmp_path / layout), target[1])
        for name, value in overrides.items():
            assert getattr(loaded.config, name) == value, (layout, name)
        assert torch.equal(_logits(loaded), _logits(drafter)), layout
    if reset:  # guard: these flags change the function, so matching logits above means they were honoured
        plain = Eagle3Drafter(drafter.config.replace(**reset))
        plain.load_state_dict(drafter.state_dict())
        assert not torch.allclose(_logits(plain), _logits(drafter))


def test_load_save_load_is_bit_exact(target, tmp_path):
    drafter = _drafter(target, draft_vocab_size=64).to(torch.bfloat16)
    first, report1 = load_drafter(write_layout(drafter, "specforge", tmp_path / "sf"), target[1])
    save_drafter(first, tmp_path / "native")
    second, report2 = load_drafter(tmp_path / "native", target[1])
    assert (report1.source_format, report2.source_format) == ("specforge", "slimspec")  # something changed
    assert report2.config.replace(source_format="specforge") == report1.config
    s1, s2 = first.state_dict(), second.state_dict()
    assert s1.keys() == s2.keys()
    for k in s1:
        assert s1[k].dtype == s2[k].dtype and torch.equal(s1[k], s2[k]), k
    assert first.fc.weight.dtype == torch.bfloat16


def test_head_borrowed_from_the_target_round_trips_and_is_strict(target, tmp_path):
    drafter = _drafter(target)
    with torch.no_grad():  # a head frozen at the target's (the SmolLM2 demo drafter's case)
        drafter.lm_head.weight.copy_(target[0].get_output_embeddings().weight)
    out = save_drafter(drafter, tmp_path / "nohead", include_head=False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    config = json.loads((out / "config.json").read_text())
    assert config["slimspec"]["lm_head_from_target"] is True
    loaded, report = load_drafter(out, target[1])
    assert report.borrowed == ["embed_tokens.weight", "lm_head.weight"]
    assert torch.equal(_logits(loaded), _logits(drafter))
    with pytest.raises(CheckpointError, match="in the file; pass the target"):
        load_drafter(out)
    config["slimspec"]["lm_head_from_target"] = False  # without the flag a missing head is a lost tensor
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensors \['lm_head.weight'\]"):
        load_drafter(out, target[1])
    both = save_drafter(drafter, tmp_path / "both", extra_config={"lm_head_from_target": True})
    with pytest.raises(CheckpointError, match="lm_head_from_target' is true, but the weights hold a head"):
        load_drafter(both, target[1])
    with pytest.raises(ValueError, match="include_head=False needs a dense head"):
        save_drafter(tiny_drafter(head_rank=4), tmp_path / "lowrank", include_head=False)
    assert not (tmp_path / "lowrank").exists()


def test_torchspec_lowrank_head_loads(target, tmp_path):
    drafter = _drafter(target, draft_vocab_size=64, head_rank=8)
    loaded, report = load_drafter(write_layout(drafter, "torchspec", tmp_path / "ts"), target[1])
    assert report.source_format == "torchspec" and loaded.config.head_rank == 8
    assert torch.equal(_logits(loaded), _logits(drafter))
    cfg = json.loads((tmp_path / "ts" / "config.json").read_text())
    cfg["lm_head_rank_divisor"] = 2
    (tmp_path / "ts" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has rank 8 but config lm_head_rank_divisor=2 gives .* = 16"):
        load_drafter(tmp_path / "ts", target[1])


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_norm_flag_semantics(target, tmp_path):
    drafter = _drafter(target, draft_vocab_size=64)
    spec = write_layout(drafter, "speculators", tmp_path / "spec")
    _edit_config(spec, norm_before_residual=None)
    loaded, report = load_drafter(spec, target[1])
    assert (
        loaded.config.norm_before_residual is True
    )  # absent in a speculators config: vLLM assumes true (P8)
    assert any("norm_before_residual absent" in w for w in report.warnings)
    _edit_config(spec, norm_before_residual=False, norm_output=True)
    assert load_drafter(spec, target[1])[0].config.norm_output_postnorm is True  # engine meaning
    sf = write_layout(drafter, "specforge", tmp_path / "sf")
    _edit_config(sf, norm_output=True)  # SpecForge <= 0.2.0: "norm before lm_head", recurrence stays pre-norm
    loaded, report = load_drafter(sf, target[1])
    assert (loaded.config.norm_output_postnorm, loaded.config.has_final_norm) == (False, True)
    assert report.norm_output_semantics == "specforge"
    engine, _ = load_drafter(sf, target[1], norm_output_semantics="engine")
    assert engine.config.norm_output_postnorm is True
    _edit_config(sf, norm_output=False)  # SpecForge <= 0.2.0: lm_head sees the un-normed h
    loaded, report = load_drafter(sf, target[1])
    assert loaded.config.has_final_norm is False and "norm.weight" in report.ignored
    h = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded.logits(h), drafter.lm_head(h))


def test_modelopt_without_final_norm(target, tmp_path):
    drafter = _drafter(target, draft_vocab_size=64, has_final_norm=False)
    loaded, report = load_drafter(write_layout(drafter, "modelopt", tmp_path / "mo"), target[1])
    assert loaded.config.has_final_norm is False
    h = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(2))
    assert torch.equal(loaded.logits(h), drafter.lm_head(h))  # no RMSNorm with weight 1 slipped in (P9)


def test_aux_layer_conventions(target, tmp_path):
    drafter = _drafter(target, draft_vocab_size=64)
    sf = write_layout(drafter, "specforge", tmp_path / "sf")
    report = inspect_drafter(sf)
    assert report.aux_layer_ids_declared == [1, 2, 3] and report.config.aux_layer_ids == (2, 3, 4)
    assert report.config.aux_layer_ids_source == "output_of_layer"
    _edit_config(sf, eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 4, 6]})
    assert inspect_drafter(sf).config.aux_layer_ids == (4, 5, 7)  # output of layer o = boundary o + 1
    report = inspect_drafter(sf, target[1])  # L = 6: o = 6 does not exist, so these are boundaries
    assert report.config.aux_layer_ids == (3, 4, 6) and report.aux_layer_ids_convention == "boundary"
    _edit_config(
        sf,
        eagle_aux_hidden_state_layer_ids=[2, 3, 5],
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
    )
    with pytest.raises(
        CheckpointError, match=r"top-level eagle_aux_hidden_state_layer_ids=\[2, 3, 5\].*disagree"
    ):
        inspect_drafter(sf)
    _edit_config(
        sf, eagle_aux_hidden_state_layer_ids=None, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]}
    )
    with pytest.raises(CheckpointError, match=r"2 aux layer ids \[1, 2\] but 'fc.weight' takes 3"):
        inspect_drafter(sf)


def test_full_head_identity_maps_are_dropped(target, tmp_path):
    drafter = _drafter(target)  # V_d == V: no d2t / t2d buffers
    state = canonical_state(drafter)
    state.pop("embed_tokens.weight")
    state["d2t"] = torch.zeros(128, dtype=torch.int64)
    state["t2d"] = torch.ones(128, dtype=torch.bool)
    folder = write_layout(drafter, "specforge", tmp_path / "sf")
    save_file(state, str(folder / "model.safetensors"))
    loaded, report = load_drafter(folder, target[1])
    assert loaded.d2t is None and set(report.ignored) == {"d2t", "t2d"}
    state["d2t"][5] = 1
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="are not the identity"):
        load_drafter(folder, target[1])


def test_streamed_writer_is_read_by_the_reference_library(tmp_path):
    tensors = {
        "a": torch.randn(3, 5).bfloat16(),
        "d2t": torch.tensor([0, 2, 5], dtype=torch.int32),
        "t2d": torch.tensor([True, False, True]),
        "s": torch.tensor(2.5, dtype=torch.float64),
    }
    save_file(tensors, str(tmp_path / "src.safetensors"))
    refs = read_safetensors_header(tmp_path / "src.safetensors")
    items = [("copied_" + k, r) for k, r in refs.items()] + [("fresh", torch.arange(6.0).view(2, 3))]
    write_safetensors(tmp_path / "out.safetensors", items, {"format": "pt"})
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as f:
        for k, t in tensors.items():
            got = f.get_tensor("copied_" + k)
            assert got.dtype == t.dtype and torch.equal(got, t)
        assert torch.equal(f.get_tensor("fresh"), torch.arange(6.0).view(2, 3))
    assert torch.equal(refs["a"].view(), tensors["a"]) and torch.equal(refs["a"].load(), tensors["a"])


# ---- bad input --------------------------------------------------------------------------------


@pytest.fixture
def sf_folder(target, tmp_path):
    return write_layout(_drafter(target, draft_vocab_size=64), "specforge", tmp_path / "sf")


def _resave(folder, edit):
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"))


def test_truncated_and_corrupt_safetensors(sf_folder, target):
    path = sf_folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: tensor '.*' needs bytes up to \d+ .* truncated"
    ):
        load_drafter(sf_folder, target[1])
    path.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: header length \d+ does not fit the file size"
    ):
        inspect_drafter(sf_folder)
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + b"{" * n + data[8 + n :])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        inspect_drafter(sf_folder)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: 5 bytes, too short"):
        inspect_drafter(sf_folder)


def test_shape_mismatch_missing_and_unexpected_tensors(sf_folder, target):
    _resave(sf_folder, lambda s: s.update({"midlayer.mlp.gate_proj.weight": torch.zeros(60, 32)}))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: 'midlayer\.mlp\.gate_proj\.weight' has shape "
        r"\[60, 32\], expected \[64, 32\] from config\.json",
    ):
        load_drafter(sf_folder, target[1])
    _resave(
        sf_folder,
        lambda s: (
            s.update({"midlayer.mlp.gate_proj.weight": torch.zeros(64, 32)}),
            s.pop("midlayer.hidden_norm.weight"),
        ),
    )
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: missing tensors \['midlayer\.hidden_norm\.weight'\]"
    ):
        load_drafter(sf_folder, target[1])
    _resave(
        sf_folder,
        lambda s: s.update(
            {"midlayer.hidden_norm.weight": torch.ones(32), "midlayer.self_attn.q_norm.weight": torch.ones(8)}
        ),
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*q_norm.*Qwen3-type draft layers"):
        load_drafter(sf_folder, target[1])
    _resave(
        sf_folder,
        lambda s: (s.pop("midlayer.self_attn.q_norm.weight"), s.update({"fc.weight_scale": torch.ones(1)})),
    )
    with pytest.raises(
        CheckpointError, match=r"config\.json: a quantised export.*dequantise it before converting$"
    ):
        load_drafter(sf_folder, target[1])


def test_missing_or_wrong_config_fields(sf_folder, target):
    _edit_config(sf_folder, hidden_size=None)
    with pytest.raises(CheckpointError, match=r"config\.json: missing field 'hidden_size'"):
        load_drafter(sf_folder, target[1])
    _edit_config(sf_folder, hidden_size=32, draft_vocab_size=60)
    with pytest.raises(
        CheckpointError,
        match=r"'lm_head\.weight' has 64 rows but config\.json says "
        r"draft_vocab_size=60",
    ):
        load_drafter(sf_folder, target[1])
    _edit_config(sf_folder, draft_vocab_size=64, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=r"config\.json: tie_word_embeddings=true"):
        load_drafter(sf_folder, target[1])
    _edit_config(sf_folder, tie_word_embeddings=False, architectures=["MysteryModel"], draft_vocab_size=None)
    with pytest.raises(CheckpointError, match="do not match any known EAGLE-3 drafter layout"):
        load_drafter(sf_folder, target[1])


def test_bad_vocab_maps_and_nonfinite_head(sf_folder, target):
    def d2t_edit(values):
        return lambda s: s.update({"d2t": torch.tensor(values, dtype=torch.int64)})

    base = load_file(str(sf_folder / "model.safetensors"))["d2t"].tolist()
    _resave(sf_folder, lambda s: s.pop("d2t"))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: draft_vocab_size=64 < vocab_size=128 but no 'd2t'"
    ):
        load_drafter(sf_folder, target[1])
    _resave(sf_folder, d2t_edit(base[:-1] + [base[-1] + 5]))
    with pytest.raises(
        CheckpointError, match=r"'d2t' maps to target ids in \[0, 131\], outside \[0, vocab_size=128\)"
    ):
        load_drafter(sf_folder, target[1])
    _resave(
        sf_folder, d2t_edit(base[:-1] + [base[-2] - 1])
    )  # last draft id -> the same target id as the one before
    with pytest.raises(CheckpointError, match=r"'d2t' maps 1 draft ids onto a target id already used"):
        load_drafter(sf_folder, target[1])
    _resave(sf_folder, d2t_edit(base))
    head = load_file(str(sf_folder / "model.safetensors"))["lm_head.weight"]
    head[3, 4] = float("nan")
    _resave(sf_folder, lambda s: s.update({"lm_head.weight": head}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: 'lm_head\.weight' has 1 NaN/inf entries"):
        load_drafter(sf_folder, target[1])
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' has 1 NaN/inf entries"):
        inspect_drafter(sf_folder)


def test_weight_file_problems(sf_folder, target, tmp_path):
    with pytest.raises(CheckpointError, match=r"no 'embed_tokens\.weight' in the file; pass the target"):
        load_drafter(sf_folder)
    shutil.copytree(sf_folder, tmp_path / "sharded")
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(
        CheckpointError,
        match=r"index\.json: 'weight_map' names shard 'model-00001-of-00002"
        r"\.safetensors', which is missing",
    ):
        load_drafter(tmp_path / "sharded", target[1])
    (sf_folder / "model.safetensors").unlink()
    (sf_folder / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot be read as a PyTorch checkpoint"):
        load_drafter(sf_folder, target[1])
    (sf_folder / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors, .* in the folder"):
        inspect_drafter(sf_folder)
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        inspect_drafter(tmp_path / "nope")
