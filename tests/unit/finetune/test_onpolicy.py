"""The on-policy recipe: selection that never keeps a worse drafter, and the whole run on tiny models."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from finetune.config import FinetuneConfig
from finetune.run import finetune
from finetune.train.report import ONPOLICY_SCORE_KIND
from finetune.train.trainer import Trainer
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from tests.helpers.eagle3_layouts import save_tiny_target
from tests.helpers.models import DATA, tiny_drafter, tiny_target, tiny_tokenizer
from tests.unit.finetune.test_trainer import make_examples


@dataclass
class _Score:
    visited_tau: float

    def to_dict(self) -> dict:
        return {"visited_tau": self.visited_tau}


def test_selection_keeps_the_initial_drafter_when_every_step_is_worse(tmp_path):
    examples, pad = make_examples(8)
    drafter = tiny_drafter(seed=2)
    initial = {k: v.clone() for k, v in drafter.state_dict().items()}
    scores = iter([2.0, 1.9, 1.7, 1.8])  # step 0, then every evaluation is worse than the start

    cfg = FinetuneConfig(
        steps=3, eval_every=1, save_every=3, batch_size=2, max_length=96, lr=1e-2, warmup_steps=0
    )
    tr = Trainer(drafter, tiny_target(), (2, 3, 4), examples[:6], examples[6:], cfg, tmp_path, pad,
                 scorer=lambda d: _Score(next(scores)))  # fmt: skip
    result = tr.run()
    assert [h["score"] for h in result.history] == [2.0, 1.9, 1.7, 1.8]
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [(x["step"], x["eval"]["score"]) for x in log if "eval" in x] == [(1, 1.9), (2, 1.7), (3, 1.8)]
    assert result.best["step"] == 0
    assert result.extra["selection"]["improved"] is False
    assert result.extra["selection"]["gain"] == 0.0
    saved, _ = load_drafter(tmp_path, target=tiny_target())
    for k, v in saved.state_dict().items():
        if k in initial and k != "embed_tokens.weight":  # embeddings are frozen (and borrowed at load)
            assert torch.equal(v, initial[k]), k  # the kept drafter is the initial one, bit for bit
    assert any(not torch.equal(a, initial[k]) for k, a in drafter.state_dict().items())  # guard: it trained


def test_onpolicy_finetune_distils_only_what_it_trains_on_and_reports_measured_tau(tmp_path):
    tpath = save_tiny_target(tiny_target(), tmp_path / "target")
    tiny_tokenizer().save_pretrained(tpath)
    save_drafter(tiny_drafter(seed=1), tmp_path / "drafter", include_embeddings=True)
    questions = [json.loads(x)["question"] for x in (DATA / "train" / "gsm8k" / "train.jsonl").open()][:20]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    cfg = FinetuneConfig(
        steps=2, batch_size=2, max_length=64, eval_every=1, eval_batches=1, save_every=2, warmup_steps=0,
        metric_prompts=3, measure_prompts=2, metric_new_tokens=10, distill_new_tokens=12,
    )  # fmt: skip
    out = tmp_path / "out"
    result = finetune(str(tpath), tmp_path / "drafter", [data], out, cfg)
    distilled = [json.loads(x) for x in (out / "distilled.jsonl").read_text().splitlines()]
    assert len(distilled) == 4  # steps * batch_size prompts: what the run consumes, no more
    held = {q for q in questions} - {r["messages"][0]["content"] for r in distilled}
    assert len(held) == 16  # 20 prompts, 4 distilled; the 3 held out are among the rest
    assert all(r["provenance"]["decoding"]["max_new_tokens"] == 12 for r in distilled)
    assert result.before["score_kind"] == ONPOLICY_SCORE_KIND
    assert result.before["score"] == result.before["onpolicy"]["visited_tau"] >= 1.0
    meas = result.extra["measured"]
    assert (meas["depth"], meas["num_prompts"]) == (3, 2) and meas["initial_tau"] >= 1.0
    report = json.loads((out / "finetune_report.json").read_text())
    assert report["extra"]["measured"] == meas and "selection" in report["extra"]


def test_the_heldout_split_follows_split_seed_not_seed(tmp_path, monkeypatch):
    """A later stage run with another --seed (new order) holds out the same prompts and examples."""
    import pytest

    from finetune import onpolicy
    from finetune.run import train_eval

    examples = list(range(100))
    held = {
        (seed, split): tuple(train_eval(None, examples, None, FinetuneConfig(seed=seed, split_seed=split))[1])
        for seed, split in ((0, 0), (1, 0), (0, 1))
    }
    assert held[(0, 0)] == held[(1, 0)] != held[(0, 1)] and len(held[(0, 0)]) == 5

    seen = []

    class StopError(Exception):
        pass

    def split(prompts, n, seed):
        seen.append(seed)
        raise StopError

    monkeypatch.setattr(onpolicy, "_split_prompts", split)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(40)))
    for cfg in (FinetuneConfig(seed=3, split_seed=0), FinetuneConfig(seed=3, split_seed=5)):
        with pytest.raises(StopError):
            onpolicy.prepare_onpolicy(None, None, (1, 2, 3), [prompts], tmp_path / "out", cfg)
    assert seen == [0, 5]
    monkeypatch.undo()
    a = onpolicy._split_prompts(list(range(40)), 16, 0)[1]
    assert (
        a
        == onpolicy._split_prompts(list(range(40)), 16, 0)[1]
        != onpolicy._split_prompts(list(range(40)), 16, 5)[1]
    )
