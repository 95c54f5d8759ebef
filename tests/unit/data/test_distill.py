"""slimspec distill: greedy answers equal plain greedy decoding, provenance, resume, benchmark refusal."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from slimspec_convert.cli import app
from slimspec_convert.data.distill import DistillConfig, distill, read_prompts
from slimspec_convert.data.records import DataError
from tests.helpers.eagle3_layouts import save_tiny_target
from tests.helpers.models import DATA, tiny_target, tiny_tokenizer

GSM8K = DATA / "train" / "gsm8k" / "train.jsonl"


@pytest.fixture()
def prompts_file(tmp_path):
    lines = GSM8K.read_text().splitlines()[:5]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": json.loads(x)["question"]}) for x in lines) + "\n")
    return path


def _render_user(tok, question: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def _plain_greedy(model, tok, question: str, max_new_tokens: int) -> str:
    ids = tok(_render_user(tok, question), return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_greedy_distill_equals_plain_greedy_decoding(prompts_file, tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    report = distill(model, tok, [prompts_file], out, DistillConfig(batch_size=3, max_new_tokens=10))
    recs = _records(out)
    assert (report.num_written, report.num_prompts, len(recs)) == (5, 5, 5)
    for rec in recs:
        question = rec["messages"][0]["content"]
        assert rec["messages"][1]["content"] == _plain_greedy(model, tok, question, 10)
    prov = recs[2]["provenance"]
    assert (prov["source"], prov["line"], prov["decoding"]["temperature"]) == (str(prompts_file), 3, 0.0)
    assert len(prov["target"]) == 16 and len(prov["chat_template"]) == 16
    assert sum(r["provenance"]["new_tokens"] for r in recs) == report.new_tokens > 0


def test_rerun_appends_only_what_is_missing(prompts_file, tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    distill(model, tok, [prompts_file], out, DistillConfig(max_new_tokens=6, limit=2))
    first = out.read_text()
    with open(out, "a") as f:
        f.write('{"messages": [{"role": "user", "con')  # a write killed mid-line
    report = distill(model, tok, [prompts_file], out, DistillConfig(max_new_tokens=6))
    assert (report.num_written, report.num_present) == (3, 2)
    assert out.read_text().startswith(first)
    lines = [
        x for x in out.read_text().splitlines() if x.startswith('{"messages": [{"role": "user", "content"')
    ]
    assert sorted(json.loads(x)["provenance"]["line"] for x in lines) == [1, 2, 3, 4, 5]
    assert distill(model, tok, [prompts_file], out, DistillConfig(max_new_tokens=6)).num_written == 0
    # other decoding settings are other records
    assert distill(model, tok, [prompts_file], out, DistillConfig(max_new_tokens=7, limit=1)).num_written == 1


def test_sampled_distill_is_reproducible_from_its_seed(prompts_file, tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    cfg = DistillConfig(max_new_tokens=8, temperature=1.0, seed=4, limit=3)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    distill(model, tok, [prompts_file], a, cfg)
    distill(model, tok, [prompts_file], b, cfg)
    assert a.read_text() == b.read_text()
    greedy = tmp_path / "g.jsonl"
    distill(model, tok, [prompts_file], greedy, DistillConfig(max_new_tokens=8, limit=3))
    answers = [r["messages"][1]["content"] for r in _records(a)]
    assert answers != [r["messages"][1]["content"] for r in _records(greedy)]  # guard: really sampled


def test_shuffle_and_exclude_choose_which_prompts_are_answered(prompts_file, tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    lines = prompts_file.read_text().splitlines()
    held = tmp_path / "held.jsonl"
    held.write_text(
        lines[1] + "\n" + json.dumps({"prompt": "  " + json.loads(lines[3])["prompt"] + " "}) + "\n"
    )
    out = tmp_path / "d.jsonl"
    cfg = DistillConfig(max_new_tokens=4, shuffle=True, seed=3, exclude=(str(held),))
    report = distill(model, tok, [prompts_file], out, cfg)
    order = [r["provenance"]["line"] for r in _records(out)]
    assert (report.num_excluded, report.num_written) == (2, 3)
    assert sorted(order) == [1, 3, 5]  # lines 2 and 4 held out, whitespace ignored
    assert order != [1, 3, 5]  # guard: seed 3 really reorders these three
    again = tmp_path / "e.jsonl"
    distill(model, tok, [prompts_file], again, cfg)
    assert [r["provenance"]["line"] for r in _records(again)] == order


def test_a_bfloat16_target_makes_other_records(prompts_file, tmp_path):
    model, tok = tiny_target(), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    distill(model, tok, [prompts_file], out, DistillConfig(max_new_tokens=4, limit=2))
    report = distill(model.bfloat16(), tok, [prompts_file], out, DistillConfig(max_new_tokens=4, limit=2))
    assert report.num_written == 2
    assert [r["provenance"]["decoding"].get("dtype") for r in _records(out)] == [
        None,
        None,
        "bfloat16",
        "bfloat16",
    ]


def test_benchmark_prompts_are_refused_by_file_line_and_benchmark(tmp_path):
    mt_bench = json.loads((DATA / "eval" / "mt_bench" / "question.jsonl").read_text().splitlines()[3])
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps({"prompt": "hello there"}) + "\n" + json.dumps({"prompt": mt_bench["turns"][0]}) + "\n"
    )
    with pytest.raises(DataError, match=r"mixed.jsonl:2: this prompt is in the benchmark data/eval/mt_bench"):
        read_prompts([path])
    assert len(read_prompts([path], allow_eval_data=True)) == 2
    with pytest.raises(DataError, match="an evaluation set, refused as training data"):
        read_prompts([DATA / "eval" / "gsm8k" / "test.jsonl"])


def test_cli_distill_refuses_benchmark_data_and_writes_nothing(tmp_path):
    tpath = save_tiny_target(tiny_target(), tmp_path / "target")
    tiny_tokenizer().save_pretrained(tpath)
    out = tmp_path / "d.jsonl"
    args = ["distill", "--target", str(tpath), "--data", str(DATA / "eval" / "mt_bench" / "question.jsonl")]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 2 and "refused as training data" in result.output
    assert not out.exists()


def test_a_gzipped_distilled_file_is_recognised_and_a_gzip_output_refused(prompts_file, tmp_path):
    import gzip

    from slimspec_convert.data.distill import is_distilled

    model, tok = tiny_target(), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    distill(model, tok, [prompts_file], out, DistillConfig(max_new_tokens=4, limit=2))
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(out.read_bytes()))
    assert is_distilled([out]) and is_distilled([gz]) and not is_distilled([prompts_file, gz])
    with pytest.raises(DataError, match=r"d2.jsonl.gz: distill appends plain JSONL"):
        distill(model, tok, [prompts_file], tmp_path / "d2.jsonl.gz", DistillConfig(max_new_tokens=4))
    assert not (tmp_path / "d2.jsonl.gz").exists()


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("smollm2-135m-instruct-onpolicy.jsonl.gz", 8036),
        ("smollm2-135m-instruct-selfprompts.jsonl.gz", 1024),
        ("smollm2-135m-instruct-selfprompts-rest.jsonl.gz", 776),
        ("smollm2-135m-instruct-copy.jsonl.gz", 1200),
        ("smollm2-135m-instruct-writing.jsonl.gz", 600),
    ],
)
def test_committed_onpolicy_answers_hold_no_benchmark_or_heldout_prompt(name, count):
    from slimspec_convert.data.distill import eval_prompt_index, is_distilled, normalise
    from slimspec_convert.data.records import read_conversations

    path = DATA / "train" / "distilled" / name
    assert is_distilled([path])
    firsts = [normalise(c[0]["content"]) for c in read_conversations([path])]
    assert len(firsts) == count
    heldout = [DATA / "heldout" / n for n in ("general24.jsonl", "copy12.jsonl", "writing24.jsonl")]
    held = {normalise(r.messages[-1][1]) for r in read_prompts(heldout)}
    bench = eval_prompt_index()
    assert len(bench) > 1000 and len(held) == 60
    assert not [t for t in firsts if t in bench or t in held]


def test_copy_prompts_leave_the_copy12_texts_out():
    """The texts ``data/heldout/copy12.jsonl`` asks the target to repeat occur in no copy training
    prompt, and its answers (the committed copy file) are to those prompts, line for line."""
    from slimspec_convert.data.records import read_conversations

    header = "Repeat the following text exactly, word for word:\n\n"
    held = [r.messages[-1][1] for r in read_prompts([DATA / "heldout" / "copy12.jsonl"])]
    assert len(held) == 12 and all(t.startswith(header) for t in held)
    texts = [t[len(header) :][:200] for t in held]
    train = [
        r.messages[-1][1] for r in read_prompts([DATA / "train" / "copy_prompts" / "copy-prompts.jsonl"])
    ]
    assert len(train) == 1200
    assert not [t for t in texts if any(t in p for p in train)]
    answers = read_conversations([DATA / "train" / "distilled" / "smollm2-135m-instruct-copy.jsonl.gz"])
    assert [c[0]["content"] for c in answers] == train


def test_cli_max_prompt_tokens_skips_and_counts_long_prompts(prompts_file, tmp_path):
    tok = tiny_tokenizer()
    tpath = save_tiny_target(tiny_target(), tmp_path / "target")
    tok.save_pretrained(tpath)
    texts = [json.loads(x)["prompt"] for x in prompts_file.read_text().splitlines()]
    lengths = [len(tok(_render_user(tok, t), add_special_tokens=False)["input_ids"]) for t in texts]
    cap = sorted(lengths)[2]  # the three shortest prompts fit (ties aside), the rest are skipped
    out = tmp_path / "d.jsonl"
    args = ["distill", "--target", str(tpath), "--data", str(prompts_file), "--out", str(out)]
    result = CliRunner().invoke(
        app, [*args, "--max-new-tokens", "2", "--max-prompt-tokens", str(cap), "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{") :])
    fit = sum(n <= cap for n in lengths)
    assert (report["num_written"], report["num_skipped_long"]) == (fit, 5 - fit)
    assert sorted(r["provenance"]["line"] for r in _records(out)) == [
        i + 1 for i, n in enumerate(lengths) if n <= cap
    ]


def test_the_progress_hook_ticks_once_per_generated_token_step(prompts_file):
    """Issue 53: a batch is one generate call; the bar must move per token step, not once per batch."""
    from slimspec_convert.data.distill import generate_answers

    model, tok = tiny_target(), tiny_tokenizer()
    texts = [_render_user(tok, r.messages[-1][1]) for r in read_prompts([prompts_file])]
    ticks = []
    cfg = DistillConfig(max_new_tokens=9)
    answers = generate_answers(model, tok, texts, cfg, on_step=lambda: ticks.append(1))
    assert answers == generate_answers(model, tok, texts, cfg)  # the hook changes nothing
    # every sequence runs to the cap or to its stop token; the batch takes as many steps as its longest
    assert len(ticks) == max(len(a) for a in answers) and 1 <= len(ticks) <= 9
    assert any(len(a) == 9 for a in answers)  # guard: a full-length batch, so 9 ticks, not 1
