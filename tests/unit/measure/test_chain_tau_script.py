"""examples/chain_tau.py: per-file tau of real chain decoding and the prompt-weighted mean."""

import json

import pytest

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.measure.chain_acceptance import measured_chain_tau
from slimspec_convert.targets.load import load_target
from tests.helpers.models import tiny_drafter, tiny_target
from tests.helpers.scripts import load_script
from tests.helpers.wordlevel import save_tiny_target_folder

ct = load_script("examples/chain_tau.py")


def test_tau_per_file_matches_real_decoding_and_the_mean_is_prompt_weighted(tmp_path):
    words = ["a", "b", "c", "d", "e"]
    target = save_tiny_target_folder(tmp_path / "t", tiny_target(), words)
    save_drafter(tiny_drafter(seed=3), tmp_path / "d")
    files = []
    for name, prompts in {"one.jsonl": ["a b c"], "three.jsonl": ["b c d", "c d e a", "e e a"]}.items():
        files.append(tmp_path / name)
        files[-1].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    args = ["--target", str(target), "--depth", "2", "--new-tokens", "12"]
    args += [x for f in files for x in ("--prompts", str(f))]
    ct.main([str(tmp_path / "out.json"), *args, f"d={tmp_path / 'd'}"])
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["prompts"] == {str(files[0]): 1, str(files[1]): 3}
    model, tok = load_target(target, "float32")
    drafter = load_drafter(tmp_path / "d", target=model)[0].float().eval()
    (row,) = got["rows"]
    for f, prompts in zip(files, (["a b c"], ["b c d", "c d e a", "e e a"]), strict=True):
        assert row["tau"][str(f)] == measured_chain_tau(model, tok, drafter, prompts, 2, 12)
        assert 1.0 <= row["tau"][str(f)] <= 3.0
    want = (row["tau"][str(files[0])] + 3 * row["tau"][str(files[1])]) / 4
    assert row["weighted_mean"] == pytest.approx(want, abs=1e-12)
