"""Calibrated (data-whitened) factorisation: the Eckart-Young bound of ``W C^(1/2)``, the moment of
the drafter's head input, and ``slimspec convert --calibration-data``.

Reference values: singular values of ``W C^(1/2)`` from ``torch.linalg.svdvals`` (float64) and
errors measured directly on the returned factors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import slimspec_convert.workflows.convert as convert_module
from slimspec_convert.cli.app import app
from slimspec_convert.data.distill import DistillConfig, distill, is_distilled
from slimspec_convert.data.examples import build_examples, collate
from slimspec_convert.data.records import read_conversations
from slimspec_convert.lowrank.calibrated import HeadCalibration, calibrated_factorize, token_row_weights
from slimspec_convert.lowrank.svd import lowrank_factorize, relative_error
from slimspec_convert.model.ttt import shift_left, ttt_unroll
from slimspec_convert.targets.forward import target_forward
from slimspec_convert.targets.load import load_target
from slimspec_convert.workflows.calibrate import (
    calibrate_from_files,
    default_calibration_files,
    head_input_moment,
    head_row_weights,
)
from slimspec_convert.workflows.convert import ConvertConfig, convert
from tests.helpers.eagle3_layouts import save_tiny_target, write_layout
from tests.helpers.models import DATA, tiny_drafter, tiny_target, tiny_tokenizer

AUX = (2, 3, 4)


def _anisotropic(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """[n, d] hidden states with scales spread over three decades and a common offset."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1, -2, d, dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * scales
    return x @ basis.T + 0.5 * torch.randn(d, generator=g, dtype=torch.float64)


def _damped_half(C: torch.Tensor, damp: float) -> torch.Tensor:
    d = C.shape[0]
    Cd = C + damp * C.diagonal().sum() / d * torch.eye(d, dtype=torch.float64)
    lam, P = torch.linalg.eigh(Cd)
    return (P * lam.sqrt()) @ P.T


def _logit_error(W, W_up, W_down, half) -> float:
    W = W.double()
    E = (W - W_up.double() @ W_down.double()) @ half
    return float(torch.linalg.norm(E) / torch.linalg.norm(W @ half))


@pytest.mark.parametrize("damp", [1e-6, 0.01, 0.3])
def test_calibrated_factors_meet_the_eckart_young_bound_of_w_c_half(damp):
    g = torch.Generator().manual_seed(1)
    W = torch.randn(300, 24, generator=g)
    X = _anisotropic(4000, 24)
    C = X.T @ X / X.shape[0]
    r = 5
    fac = calibrated_factorize(W, r, C, damp=damp, out_dtype=torch.float64)
    half = _damped_half(C, damp)
    s = torch.linalg.svdvals(W.double() @ half)
    bound = float((s[r:] ** 2).sum().sqrt() / (s**2).sum().sqrt())
    assert fac.method == "calibrated" and fac.W_up.shape == (300, r) and fac.W_down.shape == (r, 24)
    assert fac.logit_relative_error == pytest.approx(bound, rel=1e-6)
    assert _logit_error(W, fac.W_up, fac.W_down, half) == pytest.approx(bound, rel=1e-6)
    assert fac.energy_retained == pytest.approx(1 - bound**2, rel=1e-9)
    assert fac.relative_error == pytest.approx(relative_error(W, fac.W_up, fac.W_down), rel=1e-6)
    plain = lowrank_factorize(W, r, method="exact", out_dtype=torch.float64)
    assert fac.svd_logit_relative_error == pytest.approx(
        _logit_error(W, plain.W_up, plain.W_down, half), rel=1e-6
    )
    assert fac.logit_relative_error < fac.svd_logit_relative_error  # strictly, for these spectra
    assert fac.relative_error > plain.relative_error  # it pays in weight space


def test_row_weighted_factors_meet_the_eckart_young_bound_of_d_half_w_c_half():
    g = torch.Generator().manual_seed(4)
    W = torch.randn(300, 24, generator=g)
    X = _anisotropic(4000, 24)
    C = X.T @ X / X.shape[0]
    counts = torch.randint(0, 50, (300,), generator=g) * (torch.rand(300, generator=g) < 0.2)
    w = token_row_weights(counts, 0.9)
    assert w.mean().item() == pytest.approx(1.0) and bool((w > 0.1).all())
    r, damp = 5, 0.01
    fac = calibrated_factorize(W, r, C, damp=damp, row_weights=w, out_dtype=torch.float64)
    half, d_half = _damped_half(C, damp), w.sqrt()[:, None]
    s = torch.linalg.svdvals(d_half * W.double() @ half)
    bound = float((s[r:] ** 2).sum().sqrt() / (s**2).sum().sqrt())
    E = d_half * (W.double() - fac.W_up @ fac.W_down) @ half
    assert float(torch.linalg.norm(E) / torch.linalg.norm(d_half * W.double() @ half)) == pytest.approx(
        bound, rel=1e-6
    )
    assert fac.logit_relative_error == pytest.approx(bound, rel=1e-6)
    assert fac.relative_error == pytest.approx(
        relative_error(W, fac.W_up, fac.W_down), rel=1e-6
    )  # unweighted
    unweighted = calibrated_factorize(W, r, C, damp=damp, out_dtype=torch.float64)
    E_u = d_half * (W.double() - unweighted.W_up @ unweighted.W_down) @ half
    assert torch.linalg.norm(E) < torch.linalg.norm(E_u)  # the weighted objective is what it minimises
    ones = calibrated_factorize(W, r, C, damp=damp, row_weights=token_row_weights(counts, 0.0))
    assert torch.allclose(
        ones.W_up @ ones.W_down, unweighted.W_up.float() @ unweighted.W_down.float(), atol=1e-5
    )
    with pytest.raises(ValueError, match="every weight must be > 0"):
        calibrated_factorize(W, r, C, row_weights=torch.zeros(300))
    with pytest.raises(ValueError, match="expected \\[300\\] finite weights"):
        calibrated_factorize(W, r, C, row_weights=torch.ones(299))
    with pytest.raises(ValueError, match="mix=1.5"):
        token_row_weights(counts, 1.5)


def test_calibrated_beats_plain_svd_on_held_out_hidden_states():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(500, 32, generator=g)
    X = _anisotropic(3000, 32, seed=3)
    held_out = _anisotropic(3000, 32, seed=3)[1500:]  # same distribution, other draws
    fac = calibrated_factorize(W, 4, X[:1500].T @ X[:1500] / 1500)
    plain = lowrank_factorize(W, 4, method="exact")

    def err(f):
        z = held_out.float() @ W.T
        return float(torch.linalg.norm(z - (held_out.float() @ f.W_down.T) @ f.W_up.T) / torch.linalg.norm(z))

    assert err(fac) < 0.5 * err(plain)


def test_isotropic_moment_gives_the_plain_truncated_svd():
    g = torch.Generator().manual_seed(4)
    W = torch.randn(200, 16, generator=g, dtype=torch.float64)
    fac = calibrated_factorize(W, 3, torch.eye(16, dtype=torch.float64))
    plain = lowrank_factorize(W, 3, method="exact")
    assert torch.allclose(fac.W_up @ fac.W_down, plain.W_up @ plain.W_down, atol=1e-10)
    assert fac.relative_error == pytest.approx(plain.relative_error, rel=1e-9)
    assert fac.logit_relative_error == pytest.approx(fac.svd_logit_relative_error, rel=1e-9)


@pytest.mark.parametrize(
    "shape,moment,damp,match",
    [
        ((64, 8), torch.eye(7), 0.01, r"second moment has shape \(7, 7\), expected \[8, 8\]"),
        ((64, 8), torch.full((8, 8), float("nan")), 0.01, "not finite or has no positive trace"),
        ((64, 8), torch.zeros(8, 8), 0.01, "not finite or has no positive trace"),
        ((64, 8), torch.eye(8), 0.0, "damp=0.0: expected > 0"),
        ((6, 8), torch.eye(8), 0.01, "needs a head with V_d >= d"),
    ],
)
def test_calibrated_factorize_rejects_bad_input(shape, moment, damp, match):
    with pytest.raises(ValueError, match=match):
        calibrated_factorize(torch.randn(*shape), 2, moment, damp=damp)


def test_head_input_moment_is_the_mean_outer_product_over_every_ttt_step():
    tok = tiny_tokenizer()
    convs = read_conversations([DATA / "train" / "gsm8k" / "train.jsonl"])[:12]
    examples = build_examples(tok, convs, 64)[:6]
    drafter, target = tiny_drafter(seed=2), tiny_target()
    cal = head_input_moment(drafter, target, examples, pad_id=tok.pad_token_id, ttt_steps=2, batch_size=4)
    batches = [collate(examples[:4], tok.pad_token_id), collate(examples[4:], tok.pad_token_id)]
    rows = sum(int(shift_left(b["loss_mask"].bool(), 2 + s, False).sum()) for b in batches for s in range(2))
    assert cal.rows == rows > 0
    with torch.no_grad():
        hs = []
        for b in batches:
            out = target_forward(target, b["input_ids"], AUX, attention_mask=b["attention_mask"])
            for st in ttt_unroll(drafter, b["input_ids"], out.aux_hidden.float(), b["loss_mask"], 2):
                hs.append(drafter.norm(st.hidden[st.valid]).double())
    h = torch.cat(hs)
    assert torch.allclose(cal.second_moment, h.T @ h / h.shape[0], rtol=1e-5, atol=1e-8)


def test_cli_convert_with_calibration_data(tmp_path, tiny_pair):
    tpath, src = tiny_pair
    data = DATA / "train" / "gsm8k" / "train.jsonl"
    runner = CliRunner()
    args = ["convert", str(src), str(tmp_path / "out"), "--rank", "4", "--target", str(tpath)]
    result = runner.invoke(
        app, [*args, "--calibration-data", str(data), "--calibration-samples", "8", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "slimspec_report.json").read_text())
    cal = report["calibration"]
    assert report["svd_method"] == "calibrated" and cal["rows"] > 0
    assert cal["source"].startswith("the target's greedy answers (<= 192 new tokens) to 8 prompts")
    assert cal["logit_relative_error"] < cal["svd_logit_relative_error"]
    w = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert w["lm_head.up.weight"].shape == (128, 4) and w["lm_head.down.weight"].shape == (4, 32)
    other = tmp_path / "out2"
    result = runner.invoke(
        app, ["convert", str(src), str(other), "--rank", "4", "--calibration-data", str(data)]
    )
    assert result.exit_code == 2 and "--calibration-data needs --target" in result.output
    assert not other.exists()


def _train_slice(root):
    """data/train-shaped folder holding the first 20 records of the two built-in calibration files."""
    (root / "gsm8k").mkdir(parents=True)
    (root / "gpteacher").mkdir()
    lines = (DATA / "train" / "gsm8k" / "train.jsonl").read_text().splitlines()[:20]
    (root / "gsm8k" / "train.jsonl").write_text("\n".join(lines) + "\n")
    code = json.loads((DATA / "train" / "gpteacher" / "codegen-instruct.json").read_text())[:20]
    (root / "gpteacher" / "codegen-instruct.json").write_text(json.dumps(code))
    return root


@pytest.fixture
def tiny_pair(tmp_path):
    """A tiny target folder with a tokenizer, and a SpecForge-layout drafter for it."""
    target = tiny_target()
    tpath = save_tiny_target(target, tmp_path / "target")
    tiny_tokenizer().save_pretrained(tpath)
    drafter = tiny_drafter(seed=6)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return tpath, write_layout(drafter, "specforge", tmp_path / "src")


def test_the_built_in_calibration_files_are_committed_training_data(tmp_path):
    files = default_calibration_files()
    train = DATA / "train"
    assert files == (str(train / "gsm8k" / "train.jsonl"), str(train / "gpteacher" / "codegen-instruct.json"))
    assert all(Path(f).is_file() and "eval" not in Path(f).relative_to(DATA).parts for f in files)
    with pytest.raises(FileNotFoundError, match="pass --calibration-data FILE .* or --no-calibration"):
        default_calibration_files(tmp_path / "no-data")


def test_convert_with_a_target_calibrates_on_the_built_in_slice_by_default(tiny_pair, tmp_path, monkeypatch):
    tpath, src = tiny_pair
    root = _train_slice(tmp_path / "train")
    monkeypatch.setattr(convert_module, "default_calibration_files", lambda: default_calibration_files(root))
    report = convert(src, tmp_path / "auto", ConvertConfig(rank=4, target=str(tpath), calibration_samples=8))
    assert report.svd_method == "calibrated" and report.warnings == []
    assert (
        "answers (<= 192 new tokens) to 8 prompts" in report.calibration["source"]
        and "codegen-instruct.json" in report.calibration["source"]
    )
    assert report.calibration["logit_relative_error"] < report.calibration["svd_logit_relative_error"]
    assert report.calibration["token_weight"] == 0.9  # rows weighted by next-token frequency by default
    # the same files given explicitly: the same moment, so the same factors, bit for bit
    files = default_calibration_files(root)
    explicit = ConvertConfig(rank=4, target=str(tpath), calibration_samples=8, calibration_data=files)
    convert(src, tmp_path / "explicit", explicit)
    a = load_file(str(tmp_path / "auto" / "model.safetensors"))
    b = load_file(str(tmp_path / "explicit" / "model.safetensors"))
    assert torch.equal(a["lm_head.up.weight"], b["lm_head.up.weight"])
    config = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert config["slimspec"]["conversion"]["calibrated"] is True


def test_an_uncalibrated_convert_warns_on_stderr_with_the_fix(tiny_pair, tmp_path):
    tpath, src = tiny_pair
    runner = CliRunner()
    res = runner.invoke(app, ["convert", str(src), str(tmp_path / "plain"), "--rank", "4"])
    assert res.exit_code == 0, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"warning: {tmp_path / 'plain'}: plain rank-4 SVD, not calibrated"
    )
    assert f"slimspec convert {src} {tmp_path / 'plain'} --target T --force" in lines[0]
    assert f"slimspec finetune --target T --drafter {tmp_path / 'plain'} --data FILE" in lines[0]
    report = json.loads((tmp_path / "plain" / "slimspec_report.json").read_text())
    assert report["warnings"] == [lines[0].removeprefix("warning: ")] and report["svd_method"] == "exact"
    args = ["convert", str(src), str(tmp_path / "opt-out"), "--rank", "4", "--target", str(tpath)]
    res = runner.invoke(app, [*args, "--no-calibration"])
    assert res.exit_code == 0, res.output
    assert "plain rank-4 SVD (--no-calibration)" in res.stderr and "slimspec finetune" in res.stderr
    assert json.loads((tmp_path / "opt-out" / "slimspec_report.json").read_text())["calibration"] == {}
    res = runner.invoke(app, [*args, "--no-calibration", "--calibration-data", "x.jsonl"])
    assert res.exit_code == 2 and "--calibration-data with --no-calibration" in res.output


def test_on_policy_calibration_is_the_moment_of_the_targets_own_answers(tiny_pair, tmp_path):
    """source='target' equals the moment of a file `distill` wrote (itself equal to plain greedy
    decoding, tests/unit/data/test_distill.py), and differs from the files' own answers."""
    tpath, src = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    lines = (DATA / "train" / "gsm8k" / "train.jsonl").read_text().splitlines()[:5]
    prompts.write_text("\n".join(lines) + "\n")
    kw = dict(samples=8, device="cpu", new_tokens=12)  # 8 >= 5 prompts: every prompt is used
    onpolicy = calibrate_from_files(src, tpath, [prompts], **kw)
    assert onpolicy.source.startswith("the target's greedy answers (<= 12 new tokens) to 5 prompts")
    model, tok = load_target(str(tpath), "float32")
    distill(model, tok, [prompts], tmp_path / "answers.jsonl", DistillConfig(max_new_tokens=12))
    assert is_distilled([tmp_path / "answers.jsonl"])
    ref = calibrate_from_files(src, tpath, [tmp_path / "answers.jsonl"], **kw)  # used as it is
    assert ref.source.startswith("5 conversations") and ref.rows == onpolicy.rows
    # same hidden states, other batches (float32 padding round-off only)
    assert torch.allclose(onpolicy.second_moment, ref.second_moment, rtol=1e-5, atol=1e-7)
    human = calibrate_from_files(src, tpath, [prompts], source="human", **kw)
    assert human.rows != onpolicy.rows
    with pytest.raises(ValueError, match="--calibration-source='files'"):
        calibrate_from_files(src, tpath, [prompts], source="files", **kw)


def test_head_row_weights_map_trimmed_rows_through_d2t():
    counts = torch.tensor([5, 0, 3, 0, 1, 0])
    cal = HeadCalibration(second_moment=torch.eye(2), rows=1, token_counts=counts)
    assert head_row_weights(cal, 6, None, 0.0) is None  # unweighted
    full = head_row_weights(cal, 6, None, 1.0)
    trimmed = head_row_weights(cal, 3, torch.tensor([0, 1, 2]), 1.0)  # rows are target ids 0, 2, 4
    assert torch.allclose(trimmed, token_row_weights(counts[[0, 2, 4]], 1.0))
    assert full.shape == (6,) and trimmed.shape == (3,)
    with pytest.raises(ValueError, match="no d2t maps them"):
        head_row_weights(cal, 3, None, 1.0)
