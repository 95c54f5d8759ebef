"""Tests of hf_generate.py: ``model.generate(..., custom_generate=speculative_generate, drafter=...)``
on tiny random targets. The reference is the independent implementation next door: plain
``model.generate`` with the same arguments (greedy), and the exact processed target distribution
computed with transformers' own warpers (sampling)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StopStringCriteria
from transformers.generation.streamers import BaseStreamer, TextIteratorStreamer, TextStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from slimspec_convert.decoding.batch import DecodeHooks
from slimspec_convert.decoding.config import SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.workflows.hf_generate import speculative_generate
from tests.helpers.decoding import CHAIN, EOS, HEADS, TREE, V
from tests.helpers.models import tiny_char_tokenizer, tiny_drafter, tiny_tokenizer

GREEDY = dict(max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)


class Recorder(BaseStreamer):
    """Keeps every put() and whether end() came."""

    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def left_pad(prompts: list[list[int]], pad: int = 0) -> dict:
    P = max(map(len, prompts))
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask}


def spec(model, drafter, **kw):
    """``speculative_generate`` with the default tree (``DraftConfig()``) unless ``draft`` is given
    (``draft="auto"``, the callable's default, is tested in tests/unit/workflows/test_hf_generate.py)."""
    kw.setdefault("draft", "tree")
    return model.generate(custom_generate=speculative_generate, drafter=drafter, **kw)


# ---- greedy equality ------------------------------------------------------------------------------
@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("draft", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_equals_plain_generate_batch1_and_left_padded_batch3(target16, prompts16, head, draft):
    drafter = tiny_drafter(seed=0, **HEADS[head])
    longest_put = 0
    for p in prompts16:
        ids = torch.tensor([p])
        rec = Recorder()
        got = spec(target16, drafter, input_ids=ids, draft=draft, streamer=rec, **GREEDY)
        assert torch.equal(got, target16.generate(ids, **GREEDY))
        assert rec.puts[0] == p and rec.ended  # generate() itself puts the prompt
        assert [t for put in rec.puts[1:] for t in put] == got[0, len(p) :].tolist()
        longest_put = max([longest_put] + [len(put) for put in rec.puts[1:]])
    batch = left_pad(prompts16)
    want = target16.generate(**batch, **GREEDY)
    assert torch.equal(spec(target16, drafter, **batch, draft=draft, **GREEDY), want)
    assert bool((batch["attention_mask"] == 0).any())  # guard: really padded
    assert longest_put >= 2  # guard: a round committed several drafts


def test_prompt_lookup_through_generate_equals_plain_generate(target16, prompts16):
    """A DraftConfig with lookup passes through ``draft=``: the padded batch decodes as plain greedy."""
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    draft = dataclasses.replace(CHAIN, depth=1, lookup=3, lookup_min_ngram=1)
    kw = {**GREEDY, "max_new_tokens": 40}
    batch = left_pad(prompts16)
    want = target16.generate(**batch, **kw)
    assert torch.equal(spec(target16, drafter, **batch, draft=draft, **kw), want)
    rec = Recorder()  # guard: some round committed lookup drafts (more than drafter depth 1 + bonus)
    spec(target16, drafter, input_ids=torch.tensor([prompts16[0]]), draft=draft, streamer=rec, **kw)
    assert max(len(put) for put in rec.puts[1:]) >= 3


def test_return_dict_in_generate_gives_the_output_object(target16, prompts16):
    drafter = tiny_drafter(seed=0, **HEADS["lowrank"])
    batch = left_pad(prompts16)
    want = target16.generate(**batch, return_dict_in_generate=True, **GREEDY)
    got = spec(target16, drafter, **batch, return_dict_in_generate=True, **GREEDY)
    assert isinstance(got, GenerateDecoderOnlyOutput) and type(got) is type(want)
    assert torch.equal(got.sequences, want.sequences)
    assert got.scores is None and got.cache is None


def test_eos_list_and_max_length(target16, prompts16):
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    p = prompts16[0]
    ids = torch.tensor([p])
    free = target16.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    new = free[0, len(p) :].tolist()
    j = next(i for i in range(3, len(new)) if new[i] not in new[:i] and new[i] != EOS)
    for kw in (dict(eos_token_id=[EOS, new[j]]), dict(eos_token_id=EOS, max_length=len(p) + 7)):
        args = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, **kw)
        if "max_length" in kw:
            args.pop("max_new_tokens")
        want = target16.generate(ids, **args)
        assert torch.equal(spec(target16, drafter, input_ids=ids, **args), want)
    assert want.shape[1] == len(p) + 7
    cut = spec(
        target16, drafter, input_ids=ids, max_new_tokens=24, eos_token_id=[EOS, new[j]], pad_token_id=0
    )
    assert cut[0, len(p) :].tolist() == new[: j + 1]  # stopped at the second eos id, first occurrence
    # A batch whose rows stop at different lengths is padded with pad_token_id, as plain generate does.
    batch = left_pad(prompts16)
    args = dict(max_new_tokens=24, do_sample=False, eos_token_id=[EOS, new[j]], pad_token_id=7)
    want = target16.generate(**batch, **args)
    assert torch.equal(spec(target16, drafter, **batch, **args), want)
    assert bool((want[:, -1] == 7).any())


# ---- streamers ------------------------------------------------------------------------------------
def test_streamers_receive_exactly_the_returned_text(target16, prompts16, capsys):
    tok = tiny_tokenizer(V)
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    ids = torch.tensor([prompts16[1]])
    it = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    out = spec(target16, drafter, input_ids=ids, streamer=it, **GREEDY)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "".join(it) == text and len(text.split()) >= 10
    capsys.readouterr()
    spec(
        target16,
        drafter,
        input_ids=ids,
        streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
        **GREEDY,
    )
    assert capsys.readouterr().out == text + "\n"  # TextStreamer ends with a newline


# ---- sampling -------------------------------------------------------------------------------------
def _exact_two_token_distribution(model, prompt, temperature, top_k, top_p) -> torch.Tensor:
    """P(y1, y2 | prompt) [V, V] of the processed target, from transformers' own warpers; after eos
    (y1 = 2) the row is padded (y2 = pad id 0), as generate() does."""

    def processed(logits):
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        scores = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, scores))
        return torch.softmax(scores, -1)

    with torch.no_grad():
        p1 = processed(model(torch.tensor([prompt])).logits[:, -1])[0]  # [V]
        seqs = torch.tensor([prompt + [y] for y in range(V)])
        p2 = processed(model(seqs).logits[:, -1])  # [V, V], row = y1
    joint = p1[:, None] * p2
    joint[EOS] = 0.0
    joint[EOS, 0] = p1[EOS]
    return joint


def test_sampling_is_lossless_through_generate(target16, prompts16):
    # The distribution test of test_speculative.py, end to end: N rows of one prompt, two tokens each.
    from tests.unit.decoding.test_speculative import _empirical_tv, _tv_bound

    T, K, P_, N = 0.9, 6, 0.95, 8000
    prompt = prompts16[0]
    exact = _exact_two_token_distribution(target16, prompt, T, K, P_)
    drafter = tiny_drafter(seed=0, **HEADS["trimmed"])
    kw = dict(do_sample=True, temperature=T, top_k=K, top_p=P_, max_new_tokens=2)
    out = spec(target16, drafter, input_ids=torch.tensor([prompt] * N), draft=TREE, seed=1, **kw)
    samples = out[:, len(prompt) :]
    tv, bound = _empirical_tv(samples, exact), _tv_bound(exact.flatten(), N)
    assert (
        bound < 0.065 and tv < bound
    )  # the test can tell a 0.1 error from sampling noise, f"TV {tv:.4f} >= bound {bound:.4f}"
    # Guard: the second token really went through draft acceptance (rounds committed >= 2 tokens).
    gen = SpeculativeGenerator(
        target16,
        None,
        drafter,
        TREE,
        SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=4, top_k=6),
        batch_size=50,
    )
    res = gen.generate([prompt] * 50, DecodeHooks(seeds=list(range(50))))
    assert sum(r.stats.committed_per_cycle[0] >= 2 for r in res) >= 5  # 9 of 50 at these seeds


def test_sampling_seeds_generator_and_global_rng(target16, prompts16):
    drafter = tiny_drafter(seed=0, **HEADS["trimmed"])
    kw = dict(
        input_ids=torch.tensor([prompts16[0]] * 2),
        do_sample=True,
        top_k=0,
        max_new_tokens=16,
    )
    a = spec(target16, drafter, seed=5, **kw)
    b = spec(target16, drafter, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # rows are independent samples, not one seed twice
    torch.manual_seed(0)
    c = spec(target16, drafter, **kw)
    torch.manual_seed(0)
    assert torch.equal(spec(target16, drafter, **kw), c)
    # The mapping onto the generator: per-row seeds drawn from the given generator, temperature 1.
    seeds = torch.randint(0, 2**62, (2,), generator=torch.Generator().manual_seed(5)).tolist()
    gen = SpeculativeGenerator(
        target16,
        None,
        drafter,
        None,
        SamplingConfig(temperature=1.0, max_new_tokens=16),
        batch_size=2,
        stop_ids=(EOS,),
    )
    res = gen.generate([prompts16[0]] * 2, DecodeHooks(seeds=seeds))
    assert [r.output_ids + [0] * (16 - len(r.output_ids)) for r in res] == a[:, len(prompts16[0]) :].tolist()


# ---- stop strings -------------------------------------------------------------------------------
def test_stop_strings_refused_by_transformers_and_honoured_when_they_arrive(target16, prompts16):
    tok = tiny_char_tokenizer(V)
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    ids = torch.tensor([prompts16[1]])
    # transformers 5.x drops the tokenizer for a callable custom_generate, so it refuses stop strings itself.
    with pytest.raises(ValueError, match="could not locate a tokenizer"):
        spec(target16, drafter, input_ids=ids, stop_strings=["ab"], tokenizer=tok, **GREEDY)
    free = target16.generate(ids, **GREEDY)[0, ids.shape[1] :].tolist()
    text = [tok.decode([t]) for t in free]
    j = next(
        i
        for i in range(3, len(free))
        if min(free[i - 1 : i + 1]) >= 3 and text[i - 1] + text[i] not in "".join(text[:i])
    )
    stop = text[j - 1] + text[j]
    want = target16.generate(ids, stop_strings=[stop], tokenizer=tok, **GREEDY)
    assert want.shape[1] == ids.shape[1] + j + 1  # guard: the stop string cut the output
    cfg = copy.deepcopy(target16.generation_config)
    cfg.update(do_sample=False, max_length=ids.shape[1] + 24, pad_token_id=0, eos_token_id=EOS)
    crits = [MaxLengthCriteria(ids.shape[1] + 24), EosTokenCriteria(EOS), StopStringCriteria(tok, [stop])]
    got = speculative_generate(
        target16, ids, LogitsProcessorList(), StoppingCriteriaList(crits), cfg, drafter=drafter, draft="tree"
    )
    assert torch.equal(got, want)


# ---- refusals -----------------------------------------------------------------------------------
class AddOne(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1


class Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


REFUSED = {
    "num_beams": (dict(num_beams=2), "num_beams=2"),
    "repetition_penalty": (dict(repetition_penalty=1.2), "repetition_penalty=1.2"),
    "output_scores": (dict(output_scores=True, return_dict_in_generate=True), "output_scores=True"),
    "min_new_tokens": (dict(min_new_tokens=3), "min_new_tokens=3"),
    "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size=2"),
    "min_p": (dict(do_sample=True, min_p=0.1), "min_p=0.1"),
    "use_cache": (dict(use_cache=False), "use_cache=False"),
    "logits_processor": (dict(logits_processor=LogitsProcessorList([AddOne()])), "logits_processor: AddOne"),
    "prefix_allowed_tokens_fn": (
        dict(prefix_allowed_tokens_fn=lambda b, ids: [3, 4]),
        "logits_processor: PrefixConstrainedLogitsProcessor",
    ),
    "stopping_criteria": (
        dict(stopping_criteria=StoppingCriteriaList([Never()])),
        "stopping_criteria: Never",
    ),
    "generator_and_seed": (dict(do_sample=True, seed=1, generator=torch.Generator()), "generator and seed"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_options_are_refused_by_name(target16, prompts16, name):
    kw, message = REFUSED[name]
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    rec = Recorder()
    with pytest.raises(ValueError, match=message):
        spec(target16, drafter, input_ids=torch.tensor([prompts16[0]]), max_new_tokens=4, streamer=rec, **kw)
    assert rec.ended  # a streamer's consumer is released even when the call is refused


def test_refused_calls_name_the_fix(target16, prompts16):
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    ids = torch.tensor([prompts16[0]])
    with pytest.raises(ValueError, match="assistant_model: speculative_generate drafts with drafter="):
        spec(target16, drafter, input_ids=ids, max_new_tokens=4, assistant_model=target16)
    with pytest.raises(ValueError, match=r"load_drafter returns \(drafter, report\)"):
        spec(target16, (drafter, None), input_ids=ids, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"drafter: dtype torch.bfloat16 .* call drafter.to\(model.dtype\)"):
        spec(target16, copy.deepcopy(drafter).to(torch.bfloat16), input_ids=ids, max_new_tokens=4)
    right = left_pad(prompts16)
    right["attention_mask"] = right["attention_mask"].flip(-1)
    with pytest.raises(ValueError, match="attention_mask: expected left padding"):
        spec(target16, drafter, **right, max_new_tokens=4)
    with pytest.raises(ValueError, match="streamer: streams one row, got a batch of 3"):
        spec(target16, drafter, **left_pad(prompts16), max_new_tokens=4, streamer=Recorder())
    with pytest.raises(ValueError, match="DraftConfig.method='beam': expected tree or chain"):
        spec(target16, drafter, input_ids=ids, max_new_tokens=4, draft="beam")


def test_plain_decoding_without_a_drafter_equals_generate(target16, prompts16):
    batch = left_pad(prompts16)
    assert torch.equal(spec(target16, None, **batch, **GREEDY), target16.generate(**batch, **GREEDY))


def test_transformers_keeps_streamer_and_tokenizer_from_a_callable(target16, prompts16):
    # Why hf_generate reads the streamer from generate()'s frame: a callable never receives it.
    seen = {}

    def probe(model, input_ids, logits_processor, stopping_criteria, generation_config, **kw):
        seen.update(kw)
        return input_ids

    rec = Recorder()
    ids = torch.tensor([prompts16[0]])
    target16.generate(ids, max_new_tokens=2, custom_generate=probe, streamer=rec, tokenizer=tiny_tokenizer(V))
    assert rec.puts == [prompts16[0]] and not rec.ended  # the prompt only, and no end()
    assert "streamer" not in seen and "tokenizer" not in seen
    assert {"attention_mask", "position_ids", "cache", "use_cache"} <= set(seen)
