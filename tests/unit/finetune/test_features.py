"""--feature-cache: the target's features stored once give the losses of a live target; a build resumes."""

import json

import pytest
import torch

from finetune.train.features import MANIFEST, FeatureCache
from tests.unit.finetune.test_trainer import AUX, make_examples, make_trainer, peaky_target


def test_cached_features_train_like_the_live_target(tmp_path):
    live = make_trainer(tmp_path / "live", steps=4, bf16_autocast=False)
    cached = make_trainer(
        tmp_path / "cached", steps=4, bf16_autocast=False, feature_cache=str(tmp_path / "f")
    )
    assert cached.prepare_features() == 24  # the 16 training examples of 4 steps of 4 + 8 held-out
    assert cached.prepare_features() == 0  # all stored
    drawn = {cached.features.key(e) for s in range(4) for e in cached._local_examples(s, 0)}
    stored = set(cached.features.index) - {cached.features.key(e) for e in cached.eval_examples}
    assert stored == drawn and len(cached.train_examples) == 32  # guard: a run shorter than an epoch
    a = [live.train_step()[0] for _ in range(4)]
    b = [cached.train_step()[0] for _ in range(4)]
    assert b == pytest.approx(a, rel=2e-2)  # bf16 storage of the features
    assert b != a  # guard: the cached path really ran
    ev_live, ev_cached = live.evaluate(), cached.evaluate()
    assert ev_cached["acceptance"] == pytest.approx(ev_live["acceptance"], abs=2e-2)


def test_a_killed_build_keeps_its_shards_and_another_target_is_refused(tmp_path):
    examples, pad = make_examples(12)
    target = peaky_target()
    cache = FeatureCache(tmp_path, target, AUX, pad, shard_examples=5)
    assert cache.build(examples[:7]) == 7  # two shards
    again = FeatureCache(tmp_path, target, AUX, pad, shard_examples=5)
    assert len(again.missing(examples)) == 5
    assert again.build(examples) == 5
    out = again.target_output(examples[:3], torch.device("cpu"))
    n = max(e.input_ids.numel() for e in examples[:3])
    assert out.aux_hidden.shape == (3, n, 96) and out.final_hidden.shape == (3, n, 32)
    assert len(set(json.loads((tmp_path / MANIFEST).read_text())["shards"].values())) == 3  # 5 + 2, then 5
    other = peaky_target()
    with torch.no_grad():
        other.lm_head.weight.mul_(2)
    with pytest.raises(ValueError, match="another target or aux layers"):
        FeatureCache(tmp_path, other, AUX, pad)
    with pytest.raises(ValueError, match="another target or aux layers"):
        FeatureCache(tmp_path, target, (1, 2, 3), pad)


def test_stored_log_normaliser_gives_the_loss_vocab_reference_from_its_rows_alone(tmp_path):
    """--loss-vocab N with a feature cache: the reference is logits[:, ids] - stored logsumexp, so the
    target's full head product never runs in a step, and the losses equal a live target's."""
    kw = dict(steps=3, train="body", bf16_autocast=False, loss_vocab=48)
    live = make_trainer(tmp_path / "live", **kw)
    cached = make_trainer(tmp_path / "cached", feature_cache=str(tmp_path / "f"), **kw)
    cached.prepare_features()
    examples = cached._local_examples(0, 0)
    batch = cached._local_batch(0, 0)
    out = cached._target(batch, examples)
    real = batch["attention_mask"].bool()  # padding positions store no normaliser
    with torch.no_grad():
        full = cached._target_logits(out.final_hidden[real])  # [M, V], the stored final states
    assert torch.allclose(out.final_lse[real], full.logsumexp(-1), atol=1e-5)
    calls = []
    cached._target_logits = lambda x: calls.append(x) or torch.zeros(0)  # the full product must not run
    a = [live.train_step()[0] for _ in range(3)]
    b = [cached.train_step()[0] for _ in range(3)]
    assert calls == [] and b == pytest.approx(a, rel=2e-2)  # bf16 storage of the features
    assert b != a  # guard: the cached path really ran


@pytest.mark.parametrize("loss_vocab", [48, 128])
def test_tempered_loss_vocab_reference_lies_between_exact_and_renormalised(tmp_path, loss_vocab):
    """--teacher-temperature 0.5 with the cache: the reference on the ids rows lies between the exact
    softmax(logits / T)[ids] and the same renormalised over ids (the T = 1 tail outside ids spread
    evenly), equals the exact one when ids is the whole vocabulary (V = 128), and the full head
    product never runs."""
    kw = dict(steps=1, train="body", bf16_autocast=False, loss_vocab=loss_vocab, teacher_temperature=0.5)
    tr = make_trainer(tmp_path / "c", feature_cache=str(tmp_path / "f"), **kw)
    tr.prepare_features()
    examples = tr._local_examples(0, 0)
    batch = tr._local_batch(0, 0)
    out = tr._target(batch, examples)
    where = batch["loss_mask"].bool()
    b, t = where.nonzero(as_tuple=True)
    with torch.no_grad():
        logits = tr._target_logits(out.final_hidden[b, t]) / 0.5
    exact = torch.log_softmax(logits, -1)[:, tr.loss_ids].exp()
    renormalised = torch.softmax(logits[:, tr.loss_ids], -1)
    tr._target_logits = lambda x: pytest.fail("the full head product ran")
    got = tr.features.loss_vocab_reference(out, where, tr.loss_ids, torch.float32, 0.5).probs
    assert got.shape == exact.shape == (len(b), loss_vocab)
    assert bool((got >= exact * (1 - 1e-4)).all()) and bool((got <= renormalised * (1 + 1e-4)).all())
    if loss_vocab == 128:
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-8)
    else:  # guard: the tail outside the 48 rows is neither dropped nor ignored
        assert float((got - exact).abs().max()) > 1e-3 and float((renormalised - got).abs().max()) > 1e-3
