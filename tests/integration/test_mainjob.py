"""Issue 6: the main job in small (5 prompts, short fine-tune) on the real SmolLM2 target and the
committed demo drafter: calibrated convert -> fine-tune -> bench e2e; greedy outputs lossless,
SlimSpec tau (the low-rank head with its top-64 rows and the sequence's tokens rescored exactly) at
least 0.9x the full head's."""

import pytest

from finetune.config import FinetuneConfig
from finetune.train.trainer import Trainer
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.examples import load_examples
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.measure.e2e import BenchE2EConfig, run_e2e
from slimspec_convert.targets.load import load_target, num_target_layers
from slimspec_convert.workflows.calibrate import head_input_moment
from slimspec_convert.workflows.convert import ConvertConfig, convert
from tests.helpers.models import REPO

DRAFTER = REPO / "drafters" / "smollm2-135m-eagle3"


@pytest.fixture(scope="module")
def main_job(smollm2_path, tmp_path_factory):
    """Run the small main job once; returns the e2e rows by name."""
    tmp_path = tmp_path_factory.mktemp("mainjob")
    model, tok = load_target(smollm2_path)
    full, _ = load_drafter(DRAFTER, target=model)
    full = full.float().eval()
    cfg = FinetuneConfig(
        steps=20,
        lr=5e-4,  # from a calibrated init: larger steps first undo it (2e-3 needs ~25 steps to recover)
        train="head",
        ttt_steps=2,
        batch_size=4,
        max_length=192,
        eval_every=20,
        eval_batches=2,
        save_every=20,
        warmup_steps=1,
    )
    train = REPO / "data" / "train"
    math, _ = load_examples(tok, [train / "gsm8k" / "train.jsonl"], cfg.max_length)
    code, _ = load_examples(tok, [train / "gpteacher" / "codegen-instruct.json"], cfg.max_length)
    examples = [e for pair in zip(math[:120], code[:120], strict=True) for e in pair]  # the prompts mix both
    calibration = head_input_moment(full, model, examples[208:240], pad_id=tok.pad_token_id)
    # the target lets convert record that the demo head is SmolLM2's tied embedding (the rerank needs it)
    report = convert(
        DRAFTER, tmp_path / "r72", ConvertConfig(target=str(smollm2_path)), calibration=calibration
    )
    assert report.rank == 72 and report.head_is_embedding is True  # d/8 for d = 576
    assert report.calibration["logit_relative_error"] < report.calibration["svd_logit_relative_error"]
    low, _ = load_drafter(tmp_path / "r72", target=model)
    low = low.float()
    trainer = Trainer(
        low,
        model,
        low.config.resolved_aux_layer_ids(num_target_layers(model)),
        examples[:200],
        examples[200:208],
        cfg,
        tmp_path / "ft",
        tok.pad_token_id,
    )
    result = trainer.run()
    tuned, _ = load_drafter(tmp_path / "ft", target=model)
    reranked, _ = load_drafter(tmp_path / "ft", target=model)
    reranked = reranked.float().eval()
    reranked.enable_rerank(64)  # as examples/quickstart.sh: the top 64 and a 512-token context pool
    prompts = [turns[0] for turns in load_prompts(REPO / "examples" / "demo_prompts.jsonl")][:5]
    e2e = run_e2e(
        model,
        tok,
        {"full": full, "slimspec": tuned.float().eval(), "slimspec-rerank": reranked},
        prompts,
        BenchE2EConfig(
            drafters=(
                ("full", str(DRAFTER)),
                ("slimspec", str(tmp_path / "ft")),
                ("slimspec-rerank", str(tmp_path / "ft")),
            ),
            rerank=(("slimspec-rerank", 64),),
            draft_method="tree",  # the pinned figures below were measured with the tree (no plan)
            max_new_tokens=24,
            reference="full",
            warmup_tokens=0,
        ),
    )
    return {r.name: r for r in e2e.rows}, result


@pytest.mark.integration
def test_main_job_is_lossless_and_finetune_lowers_kl(main_job):
    rows, result = main_job
    before, after = result.before, result.history[-1]
    assert after["step"] == 20
    assert after["kl"][0] < before["kl"][0], (before["kl"], after["kl"])  # held-out, first TTT step
    for name in ("full", "slimspec", "slimspec-rerank"):
        assert rows[name].lossless and rows[name].num_mismatched_prompts == 0, name
    assert rows["slimspec-rerank"].rerank_k == 64 and rows["slimspec"].rerank_k == 0
    assert rows["full"].tau > 1.0  # the drafter does get tokens accepted


@pytest.mark.integration
def test_main_job_reranked_slimspec_tau_at_least_0_9_of_full(main_job):
    rows, _ = main_job
    ratio = rows["slimspec-rerank"].tau / rows["full"].tau
    print(
        f"tau full {rows['full'].tau:.3f}, slimspec+rerank {rows['slimspec-rerank'].tau:.3f}, "
        f"rho_tau {ratio:.3f}"
    )
    assert ratio >= 0.9, f"rho_tau {ratio:.3f}"


# Pinned measurement, not a goal: the rank-72 head alone (no rerank) keeps rho_tau 0.603 of the
# stage-26 demo drafter (stage 24 trained on its answers' first 128 tokens cut token-exactly,
# 2026-12-05) after this test's calibrated convert and 20-step head fine-tune (measured on the
# stage-26 drafter, torch 2.13.0 CPU, float32, greedy, --linear-product auto picking the transposed
# product: tau full 2.805, slimspec 1.691, and with the rerank and its context pool 2.674);
# stage 24 gave 0.631 = 1.769 / 2.805 (rerank with its context pool 2.556),
# stage 23 gave 0.647 = 1.691 / 2.614 (rerank with its context pool 2.500),
# stage 22 gave 0.667 = 1.742 / 2.614 (rerank with its context pool 2.500; the top-64 rerank alone
# 2.347, 0.898 of the full head),
# stage 21 gave 0.721 = 1.691 / 2.347 (rerank 2.170),
# stage 20 gave 0.706 = 1.691 / 2.396 (rerank 2.300),
# stage 18 gave 0.710 = 1.667 / 2.347 (rerank 2.212),
# stage 16 gave 0.773 = 1.742 / 2.255 (rerank 2.130),
# stage 14 0.754 = 1.667 / 2.212 (rerank 2.130), stage 13 0.746 = 1.716 / 2.300 (rerank 2.170),
# stage 12 0.765 = 1.691 / 2.212, stage 10 0.773 = 1.742 / 2.255, stage 9 0.806 = 1.716 / 2.130,
# stage 7 0.767 = 1.575 / 2.054, stage 6 0.826 = 1.667 / 2.018, stage 5 0.879 = 1.742 / 1.983,
# stage 3 0.814 = 1.643 / 2.018, stage 2 0.829 = 1.643 / 1.983, the step-550 drafter 0.867 =
# 1.533 / 1.769).
# Greedy decoding is deterministic; the tolerance covers float differences across machines. A
# regression of the convert or the fine-tune moves it out of the band, an improvement too: then
# re-pin it, and so does a new demo drafter.
PINNED_SLIMSPEC_RHO_TAU = 0.603


@pytest.mark.integration
def test_main_job_slimspec_rho_tau_matches_the_pinned_measurement(main_job):
    rows, _ = main_job
    ratio = rows["slimspec"].tau / rows["full"].tau
    print(f"tau full {rows['full'].tau:.3f}, slimspec {rows['slimspec'].tau:.3f}, rho_tau {ratio:.3f}")
    assert rows["slimspec"].lossless
    assert ratio == pytest.approx(PINNED_SLIMSPEC_RHO_TAU, abs=0.03), f"rho_tau {ratio:.3f}"
