"""Tests of the decoding loop (generate.py, drafting.py, prompts.py) on tiny random targets.

Reference outputs come from an independent implementation: Hugging Face ``model.generate`` (greedy,
batch 1). Prompts are MT-Bench questions (data/eval/mt_bench) mapped byte-wise to tiny-vocabulary
ids (the tiny targets have no tokenizer).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from slimspec_convert.decoding.batch import DecodeHooks, verify_attention_mask
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.drafting import NonFiniteDecodeError
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.prompts import load_prompts
from slimspec_convert.model.kv_cache import DraftKVCache
from slimspec_convert.targets.cache import new_target_cache
from slimspec_convert.targets.forward import target_forward
from tests.helpers.decoding import CHAIN, EOS, HEADS, MT_BENCH, TREE, V, hf_greedy, mt_bench_ids
from tests.helpers.models import tiny_drafter, tiny_gemma3_target, tiny_target


@pytest.fixture(scope="module")
def reference16(target16, prompts16):
    torch.set_num_threads(1)
    return [hf_greedy(target16, p, 24) for p in prompts16]


def run(model, drafter, prompts, draft, batch_size=1, **sampling):
    sampling = {"max_new_tokens": 24, **sampling}
    gen = SpeculativeGenerator(model, None, drafter, draft, SamplingConfig(**sampling), batch_size=batch_size)
    return gen.generate(prompts)


# ---- target verification with a custom 4-D mask ---------------------------------------------
def test_tree_mask_logits_equal_plain_forward(target16):
    prompts = [[5, 9, 4, 7, 3], [8, 6, 3]]  # row 1 left-padded by 2
    ids = torch.tensor([[5, 9, 4, 7, 3], [0, 0, 8, 6, 3]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = new_target_cache()
    aux = (2, 3, 4)
    target_forward(
        target16, ids, aux, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True
    )
    # Tree: root r, children a, b of r, child c of a.  parents [-1, 0, 0, 1]
    nodes = torch.tensor([[11, 4, 12, 9], [13, 6, 10, 14]])
    depths = torch.tensor([[0, 1, 1, 2]] * 2)
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).expand(
        2, 4, 4
    )
    qpos = torch.tensor([[5], [3]]) + depths
    mask = verify_attention_mask(attn.bool(), anc, qpos, None, {"full_attention": None}, torch.float32)
    assert mask.shape == (2, 1, 4, 9)
    out = target_forward(target16, nodes, aux, attention_mask=mask, position_ids=qpos, past_key_values=cache)
    paths = [[0], [0, 1], [0, 2], [0, 1, 3]]
    for b in range(2):
        for node, path in enumerate(paths):
            seq = torch.tensor([prompts[b] + nodes[b, path].tolist()])
            plain = target_forward(target16, seq, aux)
            assert torch.allclose(out.logits[b, node], plain.logits[0, -1], atol=1e-5)
            assert torch.allclose(out.aux_hidden[b, node], plain.aux_hidden[0, -1], atol=1e-5)


# ---- greedy equality ------------------------------------------------------------------------
@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("draft", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_speculative_equals_target_greedy(target16, prompts16, reference16, head, draft):
    drafter = tiny_drafter(seed=0, **HEADS[head])
    single = run(target16, drafter, prompts16, draft, batch_size=1)
    batched = run(target16, drafter, prompts16, draft, batch_size=3)
    assert [r.output_ids for r in single] == reference16
    assert [r.output_ids for r in batched] == reference16
    # Guards: rows committed different numbers of tokens (the batch had holes to handle), and
    # drafts were accepted (a tree accepted a depth-2 path), so rollback was really exercised.
    assert len({tuple(r.stats.committed_per_cycle) for r in single}) >= 2
    assert max(max(r.stats.committed_per_cycle) for r in single) >= (3 if draft is TREE else 2)
    for r in single:
        s = r.stats
        assert s.new_tokens == len(r.output_ids) == 1 + sum(s.committed_per_cycle)
        assert s.tau == pytest.approx(sum(s.committed_per_cycle) / s.cycles)


def test_plain_target_decoding_equals_hf(target16, prompts16, reference16):
    res = run(target16, None, prompts16, None, batch_size=3)
    assert [r.output_ids for r in res] == reference16
    assert all(r.stats.tau == 1.0 and r.stats.drafter_head_ms == 0.0 for r in res)


def test_random_drafter_on_large_vocab_is_lossless_with_tau_near_one():
    target = tiny_target(seed=0, vocab_size=128)
    drafter = tiny_drafter(seed=5)
    prompts = mt_bench_ids(3, 128)
    ref = [hf_greedy(target, p, 24) for p in prompts]
    res = run(target, drafter, prompts, TREE, batch_size=3)
    assert [r.output_ids for r in res] == ref
    for r in res:
        assert 1.0 <= r.stats.tau <= 1.25


# ---- other target families (Qwen2, Qwen3, Mistral with a sliding window, hybrid Qwen2) -------
FAMILIES = {
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {"head_dim": 8}),
    "mistral-window6": ("Mistral", {"sliding_window": 6}),
    "qwen2-hybrid-window6": (
        "Qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 3},
    ),
}


def tiny_family_target(kind: str, seed: int = 3, **overrides):
    import transformers

    cfg = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    return getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**cfg)).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_greedy_equal_target(prompts16, family):
    kind, overrides = FAMILIES[family]
    model = tiny_family_target(kind, **overrides)
    ref = [hf_greedy(model, p, 24) for p in prompts16]
    if "sliding_window" in overrides:  # guard: the window changes the target's output
        full = tiny_family_target(kind, **{**overrides, "sliding_window": None, "use_sliding_window": False})
        assert [hf_greedy(full, p, 24) for p in prompts16] != ref
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    assert [r.output_ids for r in run(model, drafter, prompts16, TREE, batch_size=3)] == ref
    assert [r.output_ids for r in run(model, drafter, prompts16, CHAIN, batch_size=1)] == ref


def test_gemma3_with_sliding_layers_greedy_equals_target(prompts16):
    """Gemma 3: embedding scale, (1 + w) norms, 5 sliding layers of window 6 then a full one, a tied
    head; its own HF cache has sliding layers (``crop`` refuses them), ours rolls back by slicing."""
    model = tiny_gemma3_target(vocab_size=V, seed=4)
    assert model.config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    ref = [hf_greedy(model, p, 24) for p in prompts16]
    full = tiny_gemma3_target(vocab_size=V, seed=4, sliding_window=512)
    assert [hf_greedy(full, p, 24) for p in prompts16] != ref  # guard: the window matters
    for head in ("dense", "lowrank"):
        drafter = tiny_drafter(seed=4, **HEADS[head])
        tree = run(model, drafter, prompts16, TREE, batch_size=3)
        chain = run(model, drafter, prompts16, CHAIN, batch_size=1)
        assert [r.output_ids for r in tree] == ref
        assert [r.output_ids for r in chain] == ref
        # guards: a depth-2 tree path and 2+ chain drafts were accepted, so rollback kept real slots
        assert max(max(r.stats.committed_per_cycle) for r in tree) >= 3
        assert max(max(r.stats.committed_per_cycle) for r in chain) >= 3


# ---- stopping -------------------------------------------------------------------------------
def test_stop_token_inside_draft_stops_at_first_occurrence(target16, prompts16, reference16):
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    free = run(target16, drafter, prompts16, TREE)
    # Find a token committed in the middle of a multi-token round, at its first occurrence.
    found = None
    for i, r in enumerate(free):
        start = 1  # the prefill commits output_ids[0]
        for n in r.stats.committed_per_cycle:
            for j in range(start, start + n - 1):
                if r.output_ids[j] not in r.output_ids[:j] and r.output_ids[j] != EOS:
                    found = found or (i, j)
            start += n
    assert found is not None, "no multi-token round; pick another seed"
    i, j = found
    stop = free[i].output_ids[j]
    res = run(target16, drafter, [prompts16[i]], TREE, stop_token_ids=(stop,))
    assert res[0].output_ids == reference16[i][: j + 1]


def test_hooks_see_every_commit_and_stop_when_cuts_inside_a_round(target16, prompts16, reference16):
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    seen: dict[int, list[list[int]]] = {0: [], 1: [], 2: []}
    res = SpeculativeGenerator(target16, None, drafter, TREE, SamplingConfig(max_new_tokens=24), batch_size=2)
    out = res.generate(prompts16, DecodeHooks(on_commit=lambda row, toks: seen[row].append(list(toks))))
    for i, r in enumerate(out):
        assert [t for chunk in seen[i] for t in chunk] == r.output_ids == reference16[i]
        assert [len(c) for c in seen[i]] == [1] + r.stats.committed_per_cycle  # prefill, then rounds
    assert max(len(c) for chunks in seen.values() for c in chunks) >= 3  # multi-token commits
    # A two-token "stop string" ending inside a multi-token round (not at its end), at its first occurrence.
    found = None
    for i in range(3):
        ref, start = reference16[i], 0
        for c in seen[i]:
            for e in range(max(start, 1), start + len(c) - 1):
                if all(ref[e - 1 : e + 1] != ref[x - 1 : x + 1] for x in range(1, e)):
                    found = found or (i, e)
            start += len(c)
    assert found is not None, "no stop position inside a round; pick another seed"
    i, e = found
    bigram = reference16[i][e - 1 : e + 1]
    cut = res.generate([prompts16[i]], DecodeHooks(stop_when=lambda row, o: o[-2:] == bigram))
    assert cut[0].output_ids == reference16[i][: e + 1]
    assert len(cut[0].output_ids) < len(reference16[i])


def test_hooks_seeds_give_each_prompt_its_own_sample(target16):
    drafter = tiny_drafter(seed=0, **HEADS["trimmed"])
    gen = SpeculativeGenerator(
        target16, None, drafter, CHAIN, SamplingConfig(temperature=1.0, max_new_tokens=16), batch_size=2
    )
    same = [[5, 9, 4]] * 2
    a, b = (r.output_ids for r in gen.generate(same))
    assert a == b  # one SamplingConfig.seed for both rows
    c, d = (r.output_ids for r in gen.generate(same, DecodeHooks(seeds=[11, 12])))
    assert c != d
    assert gen.generate(same[:1], DecodeHooks(seeds=[12]))[0].output_ids == d  # a seed, not a row index
    with pytest.raises(ValueError, match="hooks.seeds has 1 seeds for 2 prompts"):
        gen.generate(same, DecodeHooks(seeds=[1]))


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 7])
def test_max_new_tokens_is_never_exceeded(target16, prompts16, budget):
    drafter = tiny_drafter(seed=0, **HEADS["dense"])
    for draft in (CHAIN, TREE):
        res = run(target16, drafter, prompts16, draft, batch_size=3, max_new_tokens=budget)
        for r, p in zip(res, prompts16, strict=True):
            assert r.output_ids == hf_greedy(target16, p, budget)
            assert len(r.output_ids) <= budget


# ---- KV caches after a younger sibling was accepted -----------------------------------------
def _fresh_caches(model, drafter, tokens: list[int], aux_layers):
    """Target and drafter caches of a fresh prefill over committed tokens minus the root."""
    cache = new_target_cache()
    ids = torch.tensor([tokens[:-1]])
    out = target_forward(model, ids, aux_layers, past_key_values=cache, use_cache=True)
    dcache = DraftKVCache()
    pos = torch.arange(len(tokens) - 1)[None]
    drafter(torch.tensor([tokens[1:]]), drafter.fuse(out.aux_hidden), pos, dcache)
    return cache, dcache


@pytest.mark.parametrize("head", ["dense", "two-layers"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_caches_equal_fresh_prefill_after_younger_sibling_accepted(target16, prompts16, batch_size, head):
    drafter = tiny_drafter(seed=0, **HEADS[head])
    gen = SpeculativeGenerator(
        target16, None, drafter, TREE, SamplingConfig(max_new_tokens=40), batch_size=batch_size
    )
    checked = 0
    with torch.inference_mode():
        for lo in range(0, 3, batch_size):
            batch = prompts16[lo : lo + batch_size]
            st = gen.start(batch)
            while st.rows and checked < 3:
                rows = list(st.rows)
                outcome = gen.step(st)
                younger = [rows[b] for b in range(len(rows)) if int(outcome.path[b, 1]) >= 2]
                for row in younger:
                    if row not in st.rows:
                        continue  # finished this round
                    b = st.rows.index(row)
                    tokens = batch[row] + st.outputs[row]
                    cache, dcache = _fresh_caches(target16, drafter, tokens, gen.aux_layers)
                    S = st.target_cache.get_seq_length()
                    slots = st.valid[b] if st.valid is not None else torch.ones(S, dtype=torch.bool)
                    assert int(slots.sum()) == len(tokens) - 1
                    for got, want in zip(st.target_cache.layers, cache.layers, strict=True):
                        assert torch.allclose(got.keys[b][:, slots], want.keys[0], atol=1e-5)
                        assert torch.allclose(got.values[b][:, slots], want.values[0], atol=1e-5)
                    for got_k, got_v, want_k, want_v in zip(
                        st.draft_cache.keys, st.draft_cache.values, dcache.keys, dcache.values, strict=True
                    ):
                        assert torch.allclose(got_k[b][:, slots], want_k[0], atol=1e-5)
                        assert torch.allclose(got_v[b][:, slots], want_v[0], atol=1e-5)
                    checked += 1
    assert checked >= 1, "no round accepted a younger sibling; pick another seed"


# ---- sampling -------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", [CHAIN, TREE, None], ids=["chain", "tree", "plain"])
def test_sampling_rows_equal_their_batch1_output(target16, prompts16, reference16, draft):
    drafter = None if draft is None else tiny_drafter(seed=0, **HEADS["trimmed"])
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    single = [run(target16, drafter, [p], draft, **kw)[0].output_ids for p in prompts16]
    batched = [r.output_ids for r in run(target16, drafter, prompts16, draft, batch_size=3, **kw)]
    assert batched == single
    assert single != reference16  # guard: really sampled


# ---- configuration errors and warnings ------------------------------------------------------
def test_drafter_without_aux_ids_warns_and_uses_defaults(caplog):
    target = tiny_target(seed=3, vocab_size=V, num_layers=8)
    drafter = tiny_drafter(seed=1, aux_layer_ids=None, **HEADS["dense"])
    with caplog.at_level(logging.WARNING, logger="slimspec_convert.targets.forward"):
        gen = SpeculativeGenerator(target, None, drafter, TREE, SamplingConfig())
    assert gen.aux_layers == (2, 4, 5)  # {2, L//2, L-3} for L = 8
    assert "no aux layer ids" in caplog.text


def test_mismatched_drafter_is_refused(target16):
    drafter = tiny_drafter(seed=1)  # vocab 128 vs the target's 16
    with pytest.raises(ValueError, match="drafter vocab_size=128 != target vocab_size=16"):
        SpeculativeGenerator(target16, None, drafter, TREE, SamplingConfig())
    with pytest.raises(ValueError, match="total_tokens=40 exceeds"):
        SpeculativeGenerator(
            target16,
            None,
            tiny_drafter(seed=0, **HEADS["dense"]),
            DraftConfig("tree", 2, 3, 40),
            SamplingConfig(),
        )


# ---- prompt files -----------------------------------------------------------------------------
def test_load_prompts_mt_bench_turns_and_prompt_lines(tmp_path):
    first = load_prompts(MT_BENCH)
    both = load_prompts(MT_BENCH, all_turns=True)
    assert len(first) == len(both) == 80
    assert first[0] == (
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
        "experiences and must-see attractions.",
    )
    assert both[0][1] == "Rewrite your previous response. Start every sentence with the letter A."
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:3: expected a 'prompt' string"):
        load_prompts(f)
    f.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert load_prompts(f) == [("hi",)]


@pytest.mark.parametrize("stage", ["target logits", "drafter lm_head"])
def test_nonfinite_logits_stop_decoding_naming_the_stage(prompts16, stage):
    target, drafter = tiny_target(seed=3, vocab_size=V), tiny_drafter(seed=1, **HEADS["dense"])
    with torch.no_grad():  # one NaN row: argmax would silently pick id 0 whenever it is hit
        (target.lm_head if stage == "target logits" else drafter.lm_head).weight[5].fill_(float("nan"))
    with pytest.raises(
        NonFiniteDecodeError, match=f"NaN/inf in the {stage} output while decoding in float32"
    ):
        run(target, drafter, prompts16[:1], CHAIN, max_new_tokens=4)


def test_a_drafter_on_another_device_than_the_target_is_refused():
    """One device for both models: a drafter left on another device fails at construction, naming both."""
    drafter = tiny_drafter(**HEADS["dense"]).to("meta")  # "meta": another device without a GPU
    with pytest.raises(
        ValueError, match=r"the drafter is on meta but the target on cpu; move both to one device"
    ):
        SpeculativeGenerator(
            tiny_target(vocab_size=V), None, drafter, CHAIN, SamplingConfig(max_new_tokens=4)
        )
