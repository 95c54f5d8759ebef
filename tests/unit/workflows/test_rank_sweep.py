"""Rank sweep: offline acceptance against an independent per-prefix implementation, SVD metrics,
the recommendation on injected tables, and the CLI end to end on tiny models."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import slimspec_convert.workflows.rank_sweep as rs
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.cli.app import app
from slimspec_convert.lowrank.calibrated import HeadCalibration, calibrated_factorize
from slimspec_convert.lowrank.svd import lowrank_factorize, relative_error
from slimspec_convert.measure.acceptance import AcceptanceStats, expected_acceptance
from slimspec_convert.measure.kappa import measure_kappa
from slimspec_convert.targets.forward import target_forward
from slimspec_convert.workflows.rank_sweep import RankSweepConfig, sweep_ranks
from tests.helpers.models import tiny_drafter, tiny_target
from tests.helpers.wordlevel import save_tiny_target_folder


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 7), generator=g)
    attn = torch.ones(2, 7, dtype=torch.int64)
    attn[1, 5:] = 0  # row 1 is right-padded after 5 tokens
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 4:] = True
    mask[1, 2:5] = True
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


@torch.no_grad()
def _naive_acceptance(drafter, target, batch):
    """Per position, rerun target and drafter on the unpadded prefix; acceptance = 1 - TV(p, q)."""
    accs, top1 = [], []
    V_d = drafter.config.draft_vocab_size
    for b in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][b]
        for t in range(ids.numel() - 2):
            if not batch["loss_mask"][b, t + 2]:
                continue
            out = target_forward(target, ids[None, : t + 2], (2, 3, 4))
            p = F.softmax(out.logits[0, -1], -1)  # target's distribution of x_{t+2}
            feat = drafter.fuse(out.aux_hidden[:, : t + 1])
            h = drafter(ids[None, 1 : t + 2], feat, torch.arange(t + 1)[None])
            q_d = F.softmax(drafter.logits(h)[0, -1].float(), -1)
            q = torch.zeros_like(p)
            q[drafter.to_target_ids(torch.arange(V_d))] = q_d
            accs.append(1 - 0.5 * (p - q).abs().sum())
            top1.append(float(q.argmax() == p.argmax()))
    return sum(accs) / len(accs), sum(top1) / len(top1), len(accs)


@pytest.mark.parametrize("draft_vocab_size", [128, 64])
def test_expected_acceptance_matches_per_prefix_reference(draft_vocab_size):
    target = tiny_target()
    drafter = tiny_drafter(draft_vocab_size=draft_vocab_size)
    batch = _batch()
    got = expected_acceptance(drafter, target, [batch])
    acc, top1, n = _naive_acceptance(drafter, target, batch)
    assert got.num_positions == n == 6  # row 0: t = 2..4 (x_4..x_6); row 1: t = 0..2 (x_2..x_4)
    assert got.expected_acceptance == pytest.approx(float(acc), abs=1e-5)
    assert got.top1_agreement == pytest.approx(top1, abs=1e-9)


def test_uniform_head_acceptance_matches_closed_form():
    # A zero head drafts the uniform distribution, so acceptance is sum_v min(p_v, 1/V) of the target alone:
    # this pins which target positions are compared (t + 1) and which are masked (loss_mask at t + 2).
    target = tiny_target()
    drafter = tiny_drafter()
    batch = _batch()
    random_head = expected_acceptance(drafter, target, [batch]).expected_acceptance
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    uniform = expected_acceptance(drafter, target, [batch])
    # Uniform q: sum_v min(p_v, 1/V) per position, from the target alone.
    out = target_forward(target, batch["input_ids"], (2, 3, 4), attention_mask=batch["attention_mask"])
    p = F.softmax(out.logits[:, 1:-1], -1)[batch["loss_mask"][:, 2:]]
    assert uniform.expected_acceptance == pytest.approx(
        float(p.detach().clamp(max=1 / 128).sum(-1).mean()), abs=1e-6
    )
    assert uniform.expected_acceptance != pytest.approx(random_head, abs=1e-3)


def test_sweep_metrics_on_tiny_drafter():
    target, drafter = tiny_target(), tiny_drafter()
    cfg = RankSweepConfig(repeats=3, num_draft_tokens=3)
    res = sweep_ranks(drafter, target, [_batch()], [4, 32], cfg, kappa=0.5)
    full, r4, r32 = res.rows
    W = drafter.lm_head.weight.detach()
    fac = lowrank_factorize(W, 4)
    assert r4.relative_error == pytest.approx(relative_error(W, fac.W_up, fac.W_down), abs=1e-5)
    assert r4.energy_retained == pytest.approx(1 - r4.relative_error**2, abs=1e-9)
    # Rank min(V_d, d) = 32 rebuilds W, so acceptance equals the full head's.
    assert r32.relative_error == pytest.approx(0.0, abs=1e-5)
    assert r32.expected_acceptance == pytest.approx(full.expected_acceptance, abs=1e-5)
    assert r4.expected_acceptance != pytest.approx(full.expected_acceptance, abs=1e-4)
    assert full.rank is None and full.nu == 1.0 and full.predicted_speedup == pytest.approx(1.0)


def test_sweep_recommendation_follows_injected_tables(monkeypatch):
    # k = 3, kappa = 0.5. tau(0.8) = 2.952, tau(0.5) = 1.875, tau(0.78) = 2.862952.
    #   r=4:  rho_tau 0.635163, nu 0.1 -> 0.635163 * 1.5 / 1.05 = 0.907375
    #   r=8:  rho_tau 0.969835, nu 0.2 -> 0.969835 * 1.5 / 1.10 = 1.322502   <- best
    #   r=16: rho_tau 1.0,      nu 0.4 -> 1.5 / 1.2 = 1.25
    alpha = {"full": 0.8, "4": 0.5, "8": 0.78, "16": 0.8}
    ms = {"full": 10.0, "4": 1.0, "8": 2.0, "16": 4.0}
    monkeypatch.setattr(
        rs,
        "expected_acceptance_by_head",
        lambda drafter, target, batches, heads: {n: AcceptanceStats(alpha[n], alpha[n], 7) for n in heads},
    )
    monkeypatch.setattr(rs, "time_module_calls", lambda heads, x, **kw: {n: ms[n] for n in heads})
    res = sweep_ranks(tiny_drafter(), None, [], [16, 4, 8], RankSweepConfig(num_draft_tokens=3), kappa=0.5)
    assert res.recommended_rank == 8
    assert [r.rank for r in res.rows] == [None, 4, 8, 16]
    assert [round(r.predicted_speedup, 6) for r in res.rows] == [1.0, 0.907375, 1.322502, 1.25]
    assert res.rows[2].tau_estimate == pytest.approx(2.862952)


def _tied_drafter():
    """A tiny drafter whose dense head is its embedding table (the rerank's precondition)."""
    drafter = tiny_drafter()
    with torch.no_grad():
        drafter.lm_head.weight.copy_(drafter.embed_tokens.weight)
    return drafter


def test_sweep_rerank_of_every_row_is_the_full_head():
    # k = V_d rescores every logit with the dense rows: each rank's logits become the full head's, so
    # acceptance and top-1 equal the full head's exactly; k = 8 rescores only rank 4's shortlist.
    target, drafter = tiny_target(), _tied_drafter()
    plain = sweep_ranks(drafter, target, [_batch()], [4], RankSweepConfig(repeats=2), kappa=0.5)
    every = sweep_ranks(drafter, target, [_batch()], [4], RankSweepConfig(repeats=2, rerank=128), kappa=0.5)
    full, r4 = every.rows
    assert every.rerank == 128 and plain.rerank == 0
    assert r4.expected_acceptance == pytest.approx(full.expected_acceptance, abs=1e-6)
    assert r4.top1_agreement == full.top1_agreement
    assert r4.expected_acceptance_svd == pytest.approx(full.expected_acceptance, abs=1e-6)
    assert plain.rows[1].expected_acceptance != pytest.approx(full.expected_acceptance, abs=1e-4)
    short = sweep_ranks(drafter, target, [_batch()], [4], RankSweepConfig(repeats=2, rerank=8), kappa=0.5)
    shortlisted = short.rows[1].expected_acceptance
    assert shortlisted not in (plain.rows[1].expected_acceptance, full.expected_acceptance)
    assert "shortlist rerank of its top 8" in rs.sweep_markdown(short)


def test_sweep_greedy_acceptance_uses_top1(monkeypatch):
    # greedy: tau from top-1 agreement (0.5 -> k = 3: 1 + 0.5 + 0.25 + 0.125 = 1.875), not from 0.8.
    stats = {"full": AcceptanceStats(0.8, 0.5, 7), "4": AcceptanceStats(0.8, 0.5, 7)}
    monkeypatch.setattr(rs, "expected_acceptance_by_head", lambda d, t, b, hs: {n: stats[n] for n in hs})
    monkeypatch.setattr(rs, "time_module_calls", lambda heads, x, **kw: {n: 1.0 for n in heads})
    cfg = RankSweepConfig(num_draft_tokens=3, acceptance="greedy")
    res = sweep_ranks(tiny_drafter(), None, [], [4], cfg, kappa=0.5)
    assert [r.tau_estimate for r in res.rows] == [pytest.approx(1.875)] * 2
    assert res.acceptance == "greedy" and "top-1 agreement" in rs.sweep_markdown(res)
    with pytest.raises(ValueError, match="acceptance='top5'"):
        RankSweepConfig(acceptance="top5")
    with pytest.raises(ValueError, match="calibration_source='files': expected one of target, human"):
        RankSweepConfig(calibration_source="files")


def test_sweep_calibrated_rows_are_converts_factors():
    # With a calibration each rank's head is calibrated_factorize's (convert's), not the plain SVD.
    target, drafter = tiny_target(), tiny_drafter()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 32, generator=g, dtype=torch.float64) * torch.linspace(
        0.1, 3.0, 32, dtype=torch.float64
    )
    cal = HeadCalibration(x.T @ x / 64, 64)
    res = sweep_ranks(
        drafter, target, [_batch()], [4], RankSweepConfig(repeats=2), kappa=0.5, calibration=cal
    )
    plain = sweep_ranks(drafter, target, [_batch()], [4], RankSweepConfig(repeats=2), kappa=0.5)
    fac = calibrated_factorize(drafter.lm_head.weight.detach().float(), 4, cal.second_moment)
    assert res.calibrated and not plain.calibrated and "Calibrated factors" in rs.sweep_markdown(res)
    assert res.rows[1].relative_error == pytest.approx(fac.relative_error, rel=1e-9)
    assert (
        res.rows[1].relative_error > plain.rows[1].relative_error
    )  # Eckart-Young: SVD is the weight optimum
    assert res.rows[1].energy_retained == pytest.approx(1 - fac.relative_error**2)
    assert res.rows[1].expected_acceptance != pytest.approx(plain.rows[1].expected_acceptance, abs=1e-6)


def test_sweep_refuses_rerank_of_an_untied_head():
    with pytest.raises(ValueError, match="is not its embedding table"):
        sweep_ranks(tiny_drafter(), None, [], [4], RankSweepConfig(rerank=8), kappa=0.5)


def test_measure_kappa_is_ratio_of_stage_times():
    m = measure_kappa(tiny_drafter(), tiny_target(), _batch()["input_ids"][:1], 3, repeats=3)
    assert m.kappa == pytest.approx(3 * m.head_ms / (3 * m.body_ms + m.fuse_ms + m.verify_ms))
    assert min(m.head_ms, m.body_ms, m.fuse_ms, m.verify_ms) > 0


def test_sweep_refuses_lowrank_head():
    with pytest.raises(ValueError, match="already low-rank"):
        sweep_ranks(tiny_drafter(head_rank=4), None, [], [2], RankSweepConfig(), kappa=0.2)


def _sweep_args(target, drafter, data, out) -> list[str]:
    """``slimspec rank-sweep`` on the given files, 3 timing repeats, JSON output."""
    args = ["rank-sweep", "--target", str(target), "--drafter", str(drafter), "--data", str(data)]
    return args + ["--out", str(out), "--repeats", "3", "--json"]


def test_cli_rank_sweep(tmp_path):
    words = ["a", "b", "c", "d", "e", "f"]
    target = save_tiny_target_folder(tmp_path / "target", tiny_target(), words)
    drafter = tiny_drafter()
    save_drafter(drafter, tmp_path / "drafter", include_embeddings=True)
    data = tmp_path / "heldout.jsonl"
    data.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "messages": [
                        {"role": "user", "content": "a b c"},
                        {"role": "assistant", "content": "d e f a b c"},
                    ]
                },
                {"question": "f e d", "answer": "c c b a w20 w30"},
            ]
        )
    )
    args = _sweep_args(target, tmp_path / "drafter", data, tmp_path / "out") + "--ranks d/8,d/2,32".split()
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [r["rank"] for r in out["rows"]] == [None, 4, 16, 32]
    assert out["kappa_source"] == "measured" and out["kappa"] == out["kappa_measurement"]["kappa"]
    assert out["rows"][3]["expected_acceptance"] == pytest.approx(
        out["rows"][0]["expected_acceptance"], abs=1e-5
    )
    best = max(out["rows"], key=lambda r: r["predicted_speedup"])
    assert out["recommended_rank"] == best["rank"]
    for name in ("rank_sweep.json", "rank_sweep.md", "rank_vs_acceptance.png", "rank_vs_latency.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert (tmp_path / "out" / "rank_vs_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "pass --force" in res.output
    extra = ["--calibration-data", str(data), "--calibration-source", "human", "--acceptance", "greedy"]
    res = CliRunner().invoke(app, [*args, "--force", *extra])
    assert res.exit_code == 0, res.output
    cal = json.loads(res.stdout)
    assert cal["calibrated"] and cal["acceptance"] == "greedy" and cal["rerank"] == 0
    assert cal["rows"][1]["relative_error"] > out["rows"][1]["relative_error"]


def _random_conversations(path, num, length, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = ["a", "b", "c", "d", "e", "f"] + [f"w{i}" for i in range(12, 128)]
    lines = []
    for _ in range(num):
        ws = [vocab[int(i)] for i in torch.randint(0, len(vocab), (length,), generator=g)]
        user, answer = " ".join(ws[:4]), " ".join(ws[4:])
        lines.append(
            json.dumps(
                {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_rank_sweep_with_head_finetune(tmp_path):
    target = save_tiny_target_folder(tmp_path / "target", tiny_target(), ["a", "b", "c", "d", "e", "f"])
    save_drafter(tiny_drafter(), tmp_path / "drafter", include_embeddings=True)
    train = _random_conversations(tmp_path / "train.jsonl", 16, 24, seed=0)
    heldout = _random_conversations(tmp_path / "heldout.jsonl", 4, 24, seed=1)
    args = _sweep_args(target, tmp_path / "drafter", heldout, tmp_path / "out")
    args += ["--ranks", "4", "--kappa", "0.3", "--finetune-steps", "3", "--finetune-data", str(train)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    full, r4 = out["rows"]
    assert out["finetune_steps"] == 3
    assert full["expected_acceptance"] == full["expected_acceptance_svd"]
    # Three KL steps on the head raise held-out acceptance above the SVD initialisation (seeded case).
    assert r4["expected_acceptance"] > r4["expected_acceptance_svd"]
    assert (tmp_path / "out" / "finetune_r4" / "model.safetensors").is_file()
    no_data = _sweep_args(target, tmp_path / "drafter", heldout, tmp_path / "out2") + [
        "--finetune-steps",
        "3",
    ]
    res = CliRunner().invoke(app, no_data)
    assert res.exit_code == 2 and "needs finetune_data" in res.output
