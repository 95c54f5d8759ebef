"""The on-policy chain metric: its arithmetic by hand, and its alignment against real decoding.

The independent reference is :class:`SpeculativeGenerator`: a greedy chain round whose last committed
token is ``x_{t+1}`` commits ``1 + (number of leading drafts equal to the target's tokens)``, so the
metric's round start ``t`` must predict exactly what the generator commits in every round it runs
(the first round starts at ``t = P - 1``, the next at ``t + committed``), prompt by prompt.
"""

from __future__ import annotations

import pytest
import torch

from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.speculative import chain_tau_from_agreement
from slimspec_convert.measure.chain_acceptance import (
    chain_acceptance,
    chain_agreement,
    onpolicy_eval_from_ids,
    visited_round_starts,
)
from tests.helpers.models import tiny_drafter, tiny_target

V, EOS, AUX = 16, 2, (2, 3, 4)


def test_chain_tau_of_drafts_agreeing_on_exactly_the_first_j_tokens():
    # four round starts whose drafts agree on exactly the first 0, 1, 2, 3 of k = 3 tokens
    # (a True after the first disagreement must not count: the chain stops there)
    agree = torch.tensor(
        [
            [False, True, True, True],
            [True, False, True, True],
            [True, True, False, True],
        ]
    )
    prefix, steps, tau = chain_tau_from_agreement(agree)
    assert prefix == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert steps == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert tau == pytest.approx(1 + (3 + 2 + 1) / 4)  # 2.5 tokens per verification


def test_chain_tau_refuses_an_empty_set():
    with pytest.raises(ValueError, match=r"expected \[k, N\] with N >= 1"):
        chain_tau_from_agreement(torch.zeros(3, 0, dtype=torch.bool))


def greedy_rows(model, prompts, max_new_tokens=24):
    rows = []
    for p in prompts:
        out = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
        rows.append((p, out[0, len(p) :].tolist()))
    return rows


def _metric_and_generator(depth):
    """Eight answers of the tiny target: (rows, agree, starts) of the chain metric and the generator's
    results of real greedy chain decoding of the same prompts."""
    target = tiny_target(seed=3, vocab_size=V)
    drafter = tiny_drafter(seed=1, vocab_size=V, draft_vocab_size=V)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 9, 4, 7, 11, 6, 8, 5)]
    rows = [r for r in greedy_rows(target, prompts) if len(r[1]) > depth + 1]
    ev = onpolicy_eval_from_ids(target, rows, AUX)
    agree, starts = chain_agreement(drafter, ev, depth)
    gen = SpeculativeGenerator(
        target, None, drafter, DraftConfig(method="chain", depth=depth), SamplingConfig(max_new_tokens=24)
    )
    return rows, agree, starts, gen.generate([p for p, _ in rows])


@pytest.mark.parametrize("depth", [1, 3])
def test_round_starts_predict_every_round_of_the_generator_exactly(depth):
    rows, agree, starts, results = _metric_and_generator(depth)
    index = {(int(n), int(t)): c for c, (n, t) in enumerate(starts.tolist())}
    predicted, measured = [], []
    for n, ((p, a), res) in enumerate(zip(rows, results, strict=True)):
        t = len(p) - 1
        for committed in res.stats.committed_per_cycle:
            # the metric's round starts need the chain inside the answer; here the bonus token too
            # (a round ending at the budget or at EOS commits fewer tokens than it accepted)
            if (n, t) in index and t + 2 + depth < len(p) + len(a):
                predicted.append(1 + int(agree[:, index[(n, t)]].int().cumprod(0).sum()))
                measured.append(committed)
            t += committed
    assert predicted == measured
    assert len(measured) >= 20 and max(measured) > 1  # guard: drafts were accepted, the check has teeth


def test_chain_acceptance_averages_every_round_start():
    target = tiny_target(seed=3, vocab_size=V)
    drafter = tiny_drafter(seed=1, vocab_size=V, draft_vocab_size=V)
    rows = greedy_rows(target, [[5, 6, 7, 8], [9, 3, 4]])
    ev = onpolicy_eval_from_ids(target, rows, AUX)
    agree, starts = chain_agreement(drafter, ev, 2)
    # every answer position t + 1 with t + 3 still inside the answer is a round start
    assert starts.shape[0] == sum(len(a) - 2 for _, a in rows)
    ca = chain_acceptance(drafter, ev, 2)
    assert ca.predicted_tau == pytest.approx(chain_tau_from_agreement(agree)[2])
    assert ca.num_positions == starts.shape[0]


def test_the_walk_visits_the_first_answer_token_then_jumps_one_plus_the_accepted():
    # sequence 0: starts t = 4..9, sequence 1: t = 2..4 (columns in round_starts' order)
    starts = torch.tensor([[0, t] for t in range(4, 10)] + [[1, t] for t in range(2, 5)])
    accepted = torch.tensor([2, 0, 0, 1, 3, 0, 0, 5, 1])
    # sequence 0: t=4 (a=2) -> t=7 (a=1) -> t=9 (a=0) -> t=10, no start; sequence 1: t=2 (a=0) ->
    # t=3 (a=5) -> t=9, no start
    visited = visited_round_starts(accepted, starts)
    assert visited.tolist() == [True, False, False, True, False, True, True, True, False]
    assert 1 + float(accepted[visited].float().mean()) == pytest.approx(1 + 8 / 5)
    with pytest.raises(ValueError, match=r"expected \[N\] and \[N, 2\]"):
        visited_round_starts(accepted[:3], starts)


@pytest.mark.parametrize("depth", [1, 3])
def test_the_walk_visits_exactly_the_rounds_of_the_generator(depth):
    rows, agree, starts, results = _metric_and_generator(depth)
    accepted = agree.int().cumprod(0).sum(0)
    visited = visited_round_starts(accepted, starts)
    walked = {tuple(x) for x in starts[visited].tolist()}
    index = {tuple(x) for x in starts.tolist()}
    real = set()
    for n, ((p, _), res) in enumerate(zip(rows, results, strict=True)):
        t = len(p) - 1
        for committed in res.stats.committed_per_cycle:
            if (n, t) not in index:  # the walk stops where no full round start is left
                break
            real.add((n, t))
            t += committed
    assert walked == real
    assert int(visited.sum()) < starts.shape[0] and int(accepted[visited].max()) > 0  # guard: jumps happen


def test_chain_acceptance_reports_the_tau_of_the_rounds_real_decoding_visits():
    target = tiny_target(seed=3, vocab_size=V)
    drafter = tiny_drafter(seed=1, vocab_size=V, draft_vocab_size=V)
    rows = greedy_rows(target, [[5, 6, 7, 8], [9, 3, 4], [4, 4, 11, 7, 3]])
    ev = onpolicy_eval_from_ids(target, rows, AUX)
    agree, starts = chain_agreement(drafter, ev, 2)
    accepted = agree.int().cumprod(0).sum(0)
    visited = visited_round_starts(accepted, starts)
    ca = chain_acceptance(drafter, ev, 2)
    assert ca.num_visited == int(visited.sum()) < ca.num_positions  # guard: the walk skips starts
    assert ca.visited_tau == pytest.approx(1 + float(accepted[visited].float().mean()))
    assert ca.visited_tau != pytest.approx(ca.predicted_tau)  # guard: the two means differ here
