"""``examples/average_drafters.py``: the uniform average of two drafter folders, tensor by tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from tests.helpers.models import tiny_drafter, tiny_target
from tests.helpers.scripts import load_script

avg = load_script("examples/average_drafters.py")


@pytest.fixture
def pair(tmp_path):
    """Two bf16 folders of one drafter: B's decoder layer moved, everything else equal; A has a notice."""
    a, b = tiny_drafter(seed=1), tiny_drafter(seed=1)
    with torch.no_grad():
        for name, p in b.named_parameters():
            if name.startswith("midlayer."):
                p.add_(torch.randn_like(p) * 0.1)
    save_drafter(a, tmp_path / "a", dtype=torch.bfloat16)
    save_drafter(b, tmp_path / "b", dtype=torch.bfloat16)
    (tmp_path / "a" / "NOTICE.md").write_text("terms travel\n")
    return tmp_path / "a", tmp_path / "b"


def test_average_is_the_float32_mean_in_the_stored_dtype_and_equal_tensors_are_kept_bit_for_bit(
    pair, tmp_path
):
    a, b = pair
    assert avg.main([str(a), str(b), str(tmp_path / "out")]) == 0
    ta, tb = load_file(str(a / avg.WEIGHTS)), load_file(str(b / avg.WEIGHTS))
    got = load_file(str(tmp_path / "out" / avg.WEIGHTS))
    assert got.keys() == ta.keys()
    changed = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert changed and all(k.startswith("midlayer.") for k in changed)
    for k in ta:
        want = ((ta[k].float() + tb[k].float()) / 2).to(ta[k].dtype) if k in changed else ta[k]
        assert got[k].dtype == ta[k].dtype and torch.equal(got[k], want), k
    cfg = json.loads((tmp_path / "out" / avg.CONFIG).read_text())
    assert cfg["slimspec"]["averaged_from"] == [str(a), str(b)]
    assert (tmp_path / "out" / "NOTICE.md").read_text() == "terms travel\n"
    # the result loads as a drafter, and averaging a folder with itself changes nothing
    drafter, _ = load_drafter(tmp_path / "out", target=tiny_target())
    named = dict(drafter.named_parameters())
    compared = [k for k in changed if k in named]
    assert compared
    for k in compared:
        assert torch.equal(named[k].detach().to(got[k].dtype), got[k]), k
    assert avg.main([str(a), str(a), str(tmp_path / "same")]) == 0
    same, orig = load_file(str(tmp_path / "same" / avg.WEIGHTS)), load_file(str(a / avg.WEIGHTS))
    assert same.keys() == orig.keys()
    for k in orig:
        assert same[k].dtype == orig[k].dtype and torch.equal(_bits(same[k]), _bits(orig[k])), k
    # the header's metadata is kept (as a mapping: the safetensors writer orders it at random)
    assert _metadata(tmp_path / "same" / avg.WEIGHTS) == _metadata(a / avg.WEIGHTS)


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _metadata(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_bad_input_names_the_file_and_the_tensor_and_nothing_is_written(pair, tmp_path, capsys):
    a, b = pair
    other = tmp_path / "c"
    save_drafter(tiny_drafter(seed=1, intermediate_size=48), other, dtype=torch.bfloat16)
    assert avg.main([str(a), str(other), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {a / avg.WEIGHTS} vs {other / avg.WEIGHTS}: tensor midlayer.mlp.")
    assert not (tmp_path / "out").exists()
    assert avg.main([str(a), str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'missing' / avg.CONFIG}: not found" in capsys.readouterr().err
    (b / avg.WEIGHTS).write_bytes(b"not safetensors")
    assert avg.main([str(a), str(b), str(tmp_path / "out")]) == 2
    assert f"error: {b / avg.WEIGHTS}: not a readable safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_existing_out_is_replaced_only_with_force(pair, tmp_path, capsys):
    a, b = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert avg.main([str(a), str(b), str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert avg.main([str(a), str(b), str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / avg.WEIGHTS).is_file()


def test_unequal_integer_tensors_are_refused():
    a = {"d2t": torch.tensor([0, 1]), "w": torch.ones(2)}
    b = {"d2t": torch.tensor([0, 2]), "w": torch.zeros(2)}
    with pytest.raises(ValueError, match="tensor d2t .* differs; only floating tensors are averaged"):
        avg.average_tensors(a, b, "x vs y")
    assert torch.equal(avg.average_tensors(a, {**b, "d2t": a["d2t"]}, "x vs y")["w"], torch.full((2,), 0.5))
