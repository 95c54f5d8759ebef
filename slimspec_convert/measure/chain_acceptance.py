"""An acceptance metric that tracks generation: the drafter teacher-forced on the target's own text.

Teacher-forced agreement on human-written answers overstates what a drafter accepts in speculation,
and can rise while real tau falls (the drafter is scored on text the target does not write). Here:

1. held-out prompts are answered by the target itself (greedy ``model.generate``), once;
2. one target forward over prompt + answer gives the aux hidden states (kept, computed once);
3. the drafter runs the training-time-test unroll (:func:`~slimspec_convert.model.ttt.ttt_unroll`)
   over that text: TTT step ``s`` at position ``t`` is exactly the ``(s+1)``-th draft of a chain
   round whose last committed token is ``x_{t+1}``, given that the drafts before it were accepted;
4. greedy acceptance is top-1 agreement with the target's next token, and the predicted chain tau
   is ``1 + p_1 + ... + p_k`` with ``p_j`` the share of round starts whose first ``j`` drafts all
   agree (:func:`~slimspec_convert.decoding.speculative.chain_tau_from_agreement`).

Every answer position with a full chain ahead of it is a round start, so the prediction averages over
round starts where real decoding visits only some (a selection score, slightly optimistic as a tau);
:func:`visited_round_starts` walks the rounds real greedy decoding runs (what ``--draft auto``
predicts with), and ``measured_chain_tau`` runs real speculative decoding on the same prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from slimspec_convert.data.distill import DistillConfig, generate_answers
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.prompts import render_prompt
from slimspec_convert.decoding.speculative import chain_tau_from_agreement, tau_from_committed
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.ttt import shift_left, ttt_unroll
from slimspec_convert.model.vocab import draft_to_target_ids
from slimspec_convert.targets.forward import target_forward
from slimspec_convert.targets.load import resolve_chat


@dataclass
class OnPolicyEval:
    """Held-out prompts with the target's greedy answers and its aux hidden states (computed once).

    Attributes:
        prompts: the user prompts.
        input_ids: [N, T] int64, prompt + answer, right-padded with 0.
        answer_mask: [N, T] bool, True on answer tokens.
        aux_hidden: [N, T, K*dt] the target's aux hidden states (target dtype).
        aux_layers: the boundaries they were captured at.
    """

    prompts: list[str]
    input_ids: Tensor
    answer_mask: Tensor
    aux_hidden: Tensor
    aux_layers: tuple[int, ...]


@dataclass(frozen=True)
class ChainAcceptance:
    """Predicted greedy chain acceptance of a drafter on an :class:`OnPolicyEval`.

    Attributes:
        depth: k, drafts per round.
        prefix_rates: p_1..p_k, the share of round starts accepting at least j drafts.
        step_rates: a_1..a_k, acceptance of draft j given drafts < j were accepted.
        predicted_tau: 1 + sum_j p_j (tokens per verification, bonus included), over every round start.
        num_positions: round starts averaged.
        visited_tau: the same over the round starts greedy decoding visits
            (:func:`visited_round_starts`): the tau real chain decoding of these answers commits.
        num_visited: those round starts.
    """

    depth: int
    prefix_rates: tuple[float, ...]
    step_rates: tuple[float, ...]
    predicted_tau: float
    num_positions: int
    visited_tau: float
    num_visited: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def build_onpolicy_eval(
    model,
    tokenizer,
    prompts: list[str],
    aux_layers: tuple[int, ...],
    *,
    max_new_tokens: int = 64,
    batch_size: int = 8,
    system_prompt: str | None = None,
    chat: bool | None = None,
) -> OnPolicyEval:
    """Answer ``prompts`` with the target (greedy) and capture its aux hidden states on the answers.

    Args:
        model: target HF causal LM (eval mode).
        tokenizer: its tokenizer.
        prompts: held-out user prompts or completion prompts (never training prompts).
        aux_layers: boundary ids the drafter reads (``resolve_aux_layers``).
        max_new_tokens: answer length cap.
        batch_size: prompts per ``generate`` / forward call.
        system_prompt: None keeps the template's default.
        chat: chat template (True), completion prompts (False) or the tokenizer's choice (None,
            :func:`~slimspec_convert.targets.load.resolve_chat`).

    Returns:
        :class:`OnPolicyEval`.

    Raises:
        ValueError: no prompt; chat=True without a chat template.
    """
    if not prompts:
        raise ValueError("on-policy evaluation needs at least one held-out prompt")
    cfg = DistillConfig(batch_size=batch_size, max_new_tokens=max_new_tokens)
    use_chat = resolve_chat(tokenizer, chat).chat
    rows = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        texts = [render_prompt(tokenizer, p, use_chat, system_prompt) for p in chunk]
        answers = generate_answers(model, tokenizer, texts, cfg)
        for text, ans in zip(texts, answers, strict=True):
            rows.append((tokenizer(text, add_special_tokens=False)["input_ids"], ans))
    return onpolicy_eval_from_ids(model, rows, aux_layers, prompts=list(prompts), batch_size=batch_size)


@torch.no_grad()
def onpolicy_eval_from_ids(
    model,
    rows: list[tuple[list[int], list[int]]],
    aux_layers: tuple[int, ...],
    *,
    prompts: list[str] | None = None,
    batch_size: int = 8,
) -> OnPolicyEval:
    """An :class:`OnPolicyEval` from (prompt ids, the target's answer ids) pairs: one target forward each.

    Raises:
        ValueError: no row, or a row without answer tokens.
    """
    if not rows or any(not a for _, a in rows):
        raise ValueError("on-policy evaluation needs rows with at least one answer token each")
    T = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    answer = torch.zeros(len(rows), T, dtype=torch.bool)
    for n, (p, a) in enumerate(rows):
        ids[n, : len(p) + len(a)] = torch.tensor(list(p) + list(a))
        answer[n, len(p) : len(p) + len(a)] = True
    lengths = torch.tensor([len(p) + len(a) for p, a in rows])
    aux = []
    for i in range(0, len(rows), batch_size):
        mask = (torch.arange(T) < lengths[i : i + batch_size, None]).long()  # [B, T] right padding
        out = target_forward(
            model, ids[i : i + batch_size].to(model.device), aux_layers, attention_mask=mask.to(model.device)
        )
        aux.append(out.aux_hidden.cpu())
    names = prompts if prompts is not None else [str(p) for p, _ in rows]
    return OnPolicyEval(names, ids, answer, torch.cat(aux), tuple(aux_layers))


def _teacher_forced_chains(drafter: Eagle3Drafter, ev: OnPolicyEval, depth: int, batch_size: int):
    """Per batch of sequences: (offset, round-start mask [B, T], per depth the drafter's logits
    [N, V_d] at the round starts and the target's tokens [N] there). Eval mode while it runs."""
    if depth < 1:
        raise ValueError(f"chain depth k={depth}: expected >= 1")
    was_training = drafter.training
    drafter.eval()
    dtype = next(p.dtype for p in drafter.parameters() if p.is_floating_point())
    device = next(p.device for p in drafter.parameters())
    try:
        for i in range(0, ev.input_ids.shape[0], batch_size):
            ids = ev.input_ids[i : i + batch_size].to(device)
            ans = ev.answer_mask[i : i + batch_size].to(device)
            start = shift_left(ans, 1, False) & shift_left(ans, 1 + depth, False)  # [B, T]
            aux = ev.aux_hidden[i : i + batch_size].to(device, dtype)
            steps = [
                (drafter.logits(st.hidden[start]).float(), shift_left(ids, 2 + st.step, 0)[start])
                for st in ttt_unroll(drafter, ids, aux, ans, depth)
            ]
            yield i, start, steps
    finally:
        drafter.train(was_training)


@torch.no_grad()
def chain_agreement(
    drafter: Eagle3Drafter, ev: OnPolicyEval, depth: int, batch_size: int = 8
) -> tuple[Tensor, Tensor]:
    """Per round start, whether each of the ``depth`` teacher-forced drafts equals the target's token.

    Round start ``(n, t)``: sequence ``n``, last committed token ``x_{t+1}`` (an answer token) with
    the chain's last target token ``x_{t+1+k}`` inside the answer. Draft ``s + 1`` is TTT step ``s``
    at position ``t`` and is compared with ``x_{t+2+s}``.

    Returns:
        (agree [k, N] bool, starts [N, 2] int64 of (n, t)).

    Raises:
        ValueError: depth < 1.
    """
    ids_map = draft_to_target_ids(drafter.d2t) if drafter.d2t is not None else None
    columns, starts = [], []
    for i, start, steps in _teacher_forced_chains(drafter, ev, depth, batch_size):
        agree = []
        for logits, true in steps:
            top = logits.argmax(-1)  # [N] draft ids
            agree.append((ids_map[top] if ids_map is not None else top) == true)
        columns.append(torch.stack(agree).cpu())  # [k, N]
        rows, pos = start.nonzero(as_tuple=True)
        starts.append(torch.stack([rows.cpu() + i, pos.cpu()], dim=1))
    return torch.cat(columns, dim=1), torch.cat(starts)


def round_starts(ev: OnPolicyEval, depth: int) -> Tensor:
    """The round starts ``(n, t)`` of :func:`chain_agreement` and :func:`chain_ranks`, in their column
    order, without running a drafter: ``x_{t+1}`` and ``x_{t+1+depth}`` are answer tokens.

    Returns:
        [N, 2] int64.
    """
    ans = ev.answer_mask
    return (shift_left(ans, 1, False) & shift_left(ans, 1 + depth, False)).nonzero()


def visited_round_starts(accepted: Tensor, starts: Tensor) -> Tensor:
    """The round starts greedy speculative decoding visits, given what each one would accept.

    The mean over *every* round start over-weights easy stretches: a run of ``m`` tokens a drafter
    (or prompt lookup) gets right holds about ``m`` round starts, yet real decoding crosses it in
    about ``m / (1 + a)`` rounds. Real greedy decoding of sequence ``n`` starts its first round at
    the first answer token (``t`` = its first round start) and the next at ``t + 1 + a_t``; this walks
    that path and stops where no full round start is left (the last few answer tokens).

    Args:
        accepted: [N] drafts (or lookup tokens) accepted at each round start (any number dtype).
        starts: [N, 2] int64 ``(n, t)``, as :func:`round_starts` returns them.

    Returns:
        [N] bool, True at the starts the walk visits; ``1 + accepted[mask].mean()`` is the tau that
        real decoding of those answers commits per round (exactly, round by round, for a greedy
        chain: ``tests/unit/measure/test_chain_acceptance.py``).

    Raises:
        ValueError: mismatched shapes.
    """
    if accepted.dim() != 1 or starts.dim() != 2 or starts.shape != (accepted.shape[0], 2):
        raise ValueError(
            f"accepted {tuple(accepted.shape)} and starts {tuple(starts.shape)}: expected [N] and [N, 2]"
        )
    column = {(n, t): c for c, (n, t) in enumerate(starts.tolist())}
    first: dict[int, int] = {}
    for n, t in column:
        first[n] = min(t, first.get(n, t))
    steps = accepted.long().tolist()
    visited = torch.zeros(accepted.shape[0], dtype=torch.bool)
    for n, t in first.items():
        while (c := column.get((n, t))) is not None:
            visited[c] = True
            t += 1 + steps[c]
    return visited


@torch.no_grad()
def chain_ranks(drafter: Eagle3Drafter, ev: OnPolicyEval, depth: int, batch_size: int = 8) -> Tensor:
    """The rank of the target's token among the drafter's logits at each depth of each round start.

    Round starts and teacher forcing as :func:`chain_agreement` (the drafts before depth ``j`` are
    the target's own tokens, as on the accepted path of a chain or a tree). Rank 0 is the drafter's
    top token; a token outside a trimmed draft vocabulary gets rank ``V_d``.

    Returns:
        [depth, N] int64.

    Raises:
        ValueError: depth < 1.
    """
    to_draft = None
    if drafter.d2t is not None:  # target id -> draft row (-1 outside the draft vocabulary)
        device = drafter.d2t.device
        to_draft = torch.full((drafter.config.vocab_size,), -1, dtype=torch.int64, device=device)
        to_draft[draft_to_target_ids(drafter.d2t)] = torch.arange(
            drafter.config.draft_vocab_size, device=device
        )
    columns = []
    for _, _, steps in _teacher_forced_chains(drafter, ev, depth, batch_size):
        ranks = []
        for logits, true in steps:
            row = to_draft[true] if to_draft is not None else true
            own = logits.gather(1, row.clamp_min(0)[:, None])  # [N, 1]
            ranks.append(torch.where(row < 0, logits.shape[1], (logits > own).sum(1)))
        columns.append(torch.stack(ranks).cpu())
    return torch.cat(columns, dim=1)


def chain_acceptance(
    drafter: Eagle3Drafter, ev: OnPolicyEval, depth: int, batch_size: int = 8
) -> ChainAcceptance:
    """Predicted greedy chain tau of ``drafter`` on the target's own answers (module docstring).

    Args:
        drafter: the drafter (any head; its ``d2t`` maps draft ids to target ids).
        ev: the held-out set from :func:`build_onpolicy_eval` (same aux layers as the drafter).
        depth: k, drafts per chain round (>= 1).
        batch_size: sequences per unroll.

    Returns:
        :class:`ChainAcceptance`.

    Raises:
        ValueError: depth < 1, or no answer long enough for one full chain.
    """
    agree, starts = chain_agreement(drafter, ev, depth, batch_size)
    if agree.shape[1] == 0:
        raise ValueError(f"no held-out answer is longer than a chain of {depth} drafts")
    prefix, steps, tau = chain_tau_from_agreement(agree)
    accepted = agree.int().cumprod(0).sum(0)  # [N] drafts each round start accepts
    visited = visited_round_starts(accepted, starts)
    visited_tau = 1.0 + float(accepted[visited].float().mean())
    return ChainAcceptance(
        depth, tuple(prefix), tuple(steps), tau, int(agree.shape[1]), visited_tau, int(visited.sum())
    )


def measured_chain_tau(
    model,
    tokenizer,
    drafter: Eagle3Drafter,
    prompts: list[str],
    depth: int,
    max_new_tokens: int = 64,
    chat: bool | None = None,
) -> float:
    """Real greedy chain speculative decoding of ``prompts``: tokens committed per verification.

    Returns:
        tau over all prompts (accepted drafts + 1 bonus per verification).
    """
    gen = SpeculativeGenerator(
        model,
        tokenizer,
        drafter,
        DraftConfig(method="chain", depth=depth),
        SamplingConfig(max_new_tokens=max_new_tokens),
        chat=chat,
    )
    committed = [c for r in gen.generate(list(prompts)) for c in r.stats.committed_per_cycle]
    return float(tau_from_committed(committed))
