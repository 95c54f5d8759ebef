"""kappa (full-head time / everything else in a speculation step) from interleaved stage timings of one
chain step, without decoding (used by ``rank-sweep``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slimspec_convert.lowrank.costmodel import kappa_from_times
from slimspec_convert.measure.timing import time_interleaved
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.kv_cache import DraftKVCache
from slimspec_convert.targets.forward import resolve_aux_layers, target_forward


@dataclass(frozen=True)
class KappaMeasurement:
    """Stage times of one chain speculation step (k draft steps, one verification of k + 1 tokens).

    Attributes:
        num_draft_tokens: k.
        head_ms: one full-head call, batch 1.
        body_ms: one drafter body step (decoder layer over a cached prefix).
        fuse_ms: fusing k + 1 verified positions' aux states.
        verify_ms: target forward of k + 1 tokens over a cached prefix.
        kappa: ``k head_ms / (k body_ms + fuse_ms + verify_ms)``.
    """

    num_draft_tokens: int
    head_ms: float
    body_ms: float
    fuse_ms: float
    verify_ms: float
    kappa: float


@torch.no_grad()
def measure_kappa(
    drafter: Eagle3Drafter,
    target_model,
    input_ids: Tensor,
    num_draft_tokens: int,
    *,
    warmup: int = 1,
    repeats: int = 15,
) -> KappaMeasurement:
    """Estimate kappa on this machine from interleaved stage timings of a chain step after a real prefix.

    Args:
        drafter: drafter with the *full* head.
        target_model: HF causal LM.
        input_ids: [1, L] prefix (L >= 2), on any device (moved to the drafter's; the target must be
            on that device too). Stage times are synchronised CUDA events there.
        num_draft_tokens: k.
        warmup: untimed rounds.
        repeats: timed rounds.

    Returns:
        :class:`KappaMeasurement`.
    """
    aux_layers = resolve_aux_layers(drafter.config, target_model)
    ref = next(p for p in drafter.parameters() if p.is_floating_point())
    dtype, device = ref.dtype, ref.device
    input_ids = input_ids.to(device)
    L, k = input_ids.shape[1], num_draft_tokens
    prefill = target_forward(target_model, input_ids, aux_layers, use_cache=True)
    cache = prefill.past_key_values
    feats = drafter.fuse(prefill.aux_hidden[:, :-1].to(dtype))  # [1, L-1, d]
    dcache = DraftKVCache()
    drafter(input_ids[:, 1:], feats, torch.arange(L - 1, device=device)[None], cache=dcache)
    new_ids = input_ids[:, -1:].expand(1, k + 1).contiguous()  # [1, k+1], values do not change the cost
    step_in = (input_ids[:, -1:], feats[:, -1:], torch.tensor([[L - 1]], device=device))
    normed = drafter.norm(feats[:, -1:])  # [1, 1, d]
    aux_verify = prefill.aux_hidden[:, -(k + 1) :].to(dtype)  # [1, k+1, K*dt] (clamped by L)

    def verify():
        target_forward(target_model, new_ids, aux_layers, past_key_values=cache, use_cache=True)
        cache.crop(-(k + 1))  # drop the k + 1 verified tokens again

    def body():
        drafter(*step_in, cache=dcache)
        dcache.crop(L - 1)

    fns = {
        "head": lambda: drafter.lm_head(normed),
        "body": body,
        "fuse": lambda: drafter.fuse(aux_verify),
        "verify": verify,
    }
    t = {
        n: v.median_ms
        for n, v in time_interleaved(
            fns, device=device, warmup=warmup, repeats=repeats, min_repeats=min(3, repeats)
        ).items()
    }
    kappa = kappa_from_times(k * t["head"], k * t["body"] + t["fuse"] + t["verify"])
    return KappaMeasurement(k, t["head"], t["body"], t["fuse"], t["verify"], kappa)
