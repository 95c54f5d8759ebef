"""Self-written prompts (Magpie): the target writes user turns; kept only when finished, long enough,
new, and clear of every evaluation prompt; reproducible from the seed; a rerun resumes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import slimspec_convert.data.self_prompts as sp
from slimspec_convert.cli import app
from slimspec_convert.data.distill import read_prompts
from slimspec_convert.data.records import DataError
from slimspec_convert.data.self_prompts import SelfPromptConfig, self_prompts, user_turn_prefix
from tests.helpers.eagle3_layouts import save_tiny_target
from tests.helpers.models import DATA, tiny_target, tiny_tokenizer

EOS = 2  # tiny_tokenizer's <|im_end|>
MT_BENCH = DATA / "eval" / "mt_bench" / "question.jsonl"
MT_BENCH_81 = json.loads(MT_BENCH.read_text().splitlines()[0])["turns"][0]


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_prefix_plus_user_text_renders_as_the_template_renders_that_user_turn():
    tok = tiny_tokenizer()
    text = "How many apples did she buy?"
    for system in (None, "Be brief."):
        msgs = [{"role": "system", "content": system}] if system else []
        full = tok.apply_chat_template(msgs + [{"role": "user", "content": text}], tokenize=False)
        prefix = user_turn_prefix(tok, system)
        assert full.startswith(prefix + text) and prefix.rstrip().endswith("user")


def test_a_tokenizer_without_chat_template_is_refused():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        user_turn_prefix(tok)


def _scripted(monkeypatch, tok, outputs):
    """generate_answers returns outputs[b] for batch b; token id k decodes to TEXTS[k]."""
    texts = {10 + i: t for i, (t, _) in enumerate(o for batch in outputs for o in batch)}
    ids = {t: k for k, t in texts.items()}
    calls = []

    def fake_generate(model, tokenizer, prompts, cfg, batch_index=0):
        calls.append((batch_index, len(prompts), cfg.seed, cfg.temperature, prompts[0]))
        return [[ids[t]] + ([EOS] if done else []) for t, done in outputs[batch_index]]

    monkeypatch.setattr(sp, "generate_answers", fake_generate)
    monkeypatch.setattr(tok, "decode", lambda row, skip_special_tokens=True: texts[row[0]])
    return calls


def test_unfinished_short_duplicate_and_benchmark_turns_are_dropped(monkeypatch, tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    model.generation_config.eos_token_id = EOS
    good = ["How do I plan a small garden party?", "What is a good first programming language?"]
    batch0 = [
        (good[0], True),
        ("Write me a long story about the sea and", False),  # unfinished: no end of turn
        ("Hi there", True),  # short: 2 words < 4
        (" how do  I plan a small garden party? ", True),  # duplicate after whitespace normalising
        (MT_BENCH_81, True),  # an MT-Bench prompt
        ("Please compose an engaging travel blog post about a recent trip to Oslo.", True),  # 8-word run
    ]
    batch1 = [(good[1], True), ("Which is larger, a whale or an elephant?", True)]
    calls = _scripted(monkeypatch, tok, [batch0, batch1])
    out = tmp_path / "p.jsonl"
    cfg = SelfPromptConfig(num=2, seed=5, batch_size=6)
    report = self_prompts(model, tok, out, cfg)
    assert [r["prompt"] for r in _lines(out)] == good
    assert report.dropped == {"unfinished": 1, "short": 1, "duplicate": 1, "eval": 1, "overlap": 1}
    assert (report.num_written, report.num_present, report.batches) == (2, 0, 2)
    assert [c[0] for c in calls] == [0, 1] and all(c[2:4] == (5, 1.0) for c in calls)
    assert calls[0][4] == user_turn_prefix(tok)
    assert [r["self_prompt"]["batch"] for r in _lines(out)] == [0, 1]
    assert [p.messages for p in read_prompts([out])] == [(("user", t),) for t in good]


def test_a_rerun_resumes_after_the_last_batch_written(monkeypatch, tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    model.generation_config.eos_token_id = EOS
    batches = [[("What should I cook for dinner tonight?", True)], [("How far away is the moon?", True)]]
    batches.append([("What should I cook for dinner tonight?", True)])  # already in the file
    batches.append([("Why is the sky blue during the day?", True)])
    calls = _scripted(monkeypatch, tok, batches)
    out = tmp_path / "p.jsonl"
    self_prompts(model, tok, out, SelfPromptConfig(num=2, batch_size=1))
    report = self_prompts(model, tok, out, SelfPromptConfig(num=3, batch_size=1))
    assert [c[0] for c in calls] == [0, 1, 2, 3]
    assert (report.num_present, report.num_written, report.dropped) == (2, 1, {"duplicate": 1})
    assert len(_lines(out)) == 3 and _lines(out)[-1]["self_prompt"]["batch"] == 3
    assert self_prompts(model, tok, out, SelfPromptConfig(num=3, batch_size=1)).num_written == 0


def test_sampled_turns_are_reproducible_from_the_seed(tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    model.generation_config.eos_token_id = EOS  # a random tiny model closes ~40% of 64-token turns
    cfg = SelfPromptConfig(num=4, seed=3, batch_size=8, max_new_tokens=64, min_words=1)
    a, b, c = (tmp_path / f"{n}.jsonl" for n in "abc")
    self_prompts(model, tok, a, cfg)
    self_prompts(model, tok, b, cfg)
    self_prompts(model, tok, c, SelfPromptConfig(**{**cfg.__dict__, "seed": 4}))
    assert a.read_text() == b.read_text() and len(_lines(a)) == 4
    assert a.read_text() != c.read_text()


def test_too_many_unfinished_batches_stop_with_a_clear_error(monkeypatch, tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    model.generation_config.eos_token_id = EOS
    _scripted(monkeypatch, tok, [[("never closed turn of words", False)]] * 3)
    with pytest.raises(DataError, match="3 batches gave 0 prompts"):
        self_prompts(model, tok, tmp_path / "p.jsonl", SelfPromptConfig(num=1, batch_size=1, max_batches=3))


def test_cli_refuses_a_gzip_output_and_bad_settings(tmp_path):
    tpath = save_tiny_target(tiny_target(), tmp_path / "target")
    tiny_tokenizer().save_pretrained(tpath)
    args = ["self-prompts", "--target", str(tpath), "--num", "2"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "p.jsonl.gz")])
    assert result.exit_code == 2 and "p.jsonl.gz" in result.output and "plain JSONL" in result.output
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "p.jsonl"), "--temperature", "0"])
    assert result.exit_code != 0 and "temperature" in result.output
    assert not (tmp_path / "p.jsonl").exists()


def _assert_kept_by_the_filters(texts: list[str]) -> None:
    """Re-check committed self-prompts in order against the rules above (nothing to drop) and
    against the general held-out prompts (none is one)."""
    from slimspec_convert.data.distill import eval_prompt_index, normalise

    cfg, index, seen = SelfPromptConfig(num=1), eval_prompt_index(), set()
    runs = sp.eval_word_runs(cfg.overlap_words, index)
    for t in texts:
        assert sp.drop_reason(t, seen, index, runs, cfg) is None, t
        seen.add(sp._dedup_key(t))
    held = {normalise(r.messages[-1][1]) for r in read_prompts([DATA / "heldout" / "general24.jsonl"])}
    assert not held & {normalise(t) for t in texts}


def test_committed_self_prompts_pass_every_filter_and_their_answers_match_them():
    """The committed prompts were kept by the rules above: re-checking each against the ones before
    finds nothing to drop (and none is a held-out prompt); the committed answers are to its first
    1,024, in order."""
    from slimspec_convert.data.records import read_conversations

    path = DATA / "train" / "self_prompts" / "smollm2-135m-instruct.jsonl"
    texts = [r.messages[-1][1] for r in read_prompts([path])]
    assert len(texts) == 1800
    _assert_kept_by_the_filters(texts)
    distilled = DATA / "train" / "distilled" / "smollm2-135m-instruct-selfprompts.jsonl.gz"
    answers = read_conversations([distilled])
    assert [c[0]["content"] for c in answers] == texts[:1024]
    rest = read_conversations([distilled.with_name("smollm2-135m-instruct-selfprompts-rest.jsonl.gz")])
    assert [c[0]["content"] for c in rest] == texts[1024:]


def test_committed_writing_prompts_pass_every_filter_and_split_into_answers_and_writing24():
    """The 624 writing-steered self-prompts (``--system-prompt`` of the data README) were kept by the
    same rules; the committed answers are to the first 600, in order, and the last 24 are
    ``data/heldout/writing24.jsonl`` (source and line given), answered nowhere."""
    from slimspec_convert.data.records import read_conversations

    path = DATA / "train" / "self_prompts" / "smollm2-135m-instruct-writing.jsonl"
    records = _lines(path)
    texts = [r["prompt"] for r in records]
    assert len(texts) == 624 and all(
        r["self_prompt"]["system_prompt"].startswith("You are a skilled") for r in records
    )
    _assert_kept_by_the_filters(texts)
    held = _lines(DATA / "heldout" / "writing24.jsonl")
    assert [h["prompt"] for h in held] == texts[600:]
    assert [h["line"] for h in held] == list(range(601, 625))
    assert {h["source"] for h in held} == {"data/train/self_prompts/smollm2-135m-instruct-writing.jsonl"}
    answers = read_conversations([DATA / "train" / "distilled" / "smollm2-135m-instruct-writing.jsonl.gz"])
    assert [c[0]["content"] for c in answers] == texts[:600]
