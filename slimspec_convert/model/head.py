"""The low-rank LM head and the function that swaps it into a drafter (pure math, no files)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimspec_convert.lowrank.svd import Factorization
from slimspec_convert.model.vocab_pick import block_topk

DEFAULT_RERANK_CONTEXT = 512  # distinct sequence tokens a rerank rescores too: + 512 d per token


class LowRankHead(nn.Module):
    """``z = W_up (W_down h)``: two bias-free linears with nothing between them (SlimSpec eq. 1).

    Parameter names give the state-dict keys ``lm_head.down.weight`` [r, d] and
    ``lm_head.up.weight`` [V_d, r], the layout of lightseekorg/TorchSpec PR #185.

    Optional shortlist rerank (:meth:`set_rerank`, off by default, inference only): the low-rank
    logits preview the vocabulary, the top ``k`` rows are rescored exactly with full-rank rows
    ``E[i] . h`` (SVD-softmax, Shim et al., NeurIPS 2017). Cost ``r (d + V_d) + k d`` per token.
    A context pool adds the tokens already in the sequence (prompt and answer, passed to
    :meth:`forward` as ``context``): a rank-r preview ranks the rare content words a text repeats
    (names, topic words) far down, where no top-k reaches, so they are rescored by id instead
    (``+ C d`` per token for C context tokens).

    Args:
        hidden_size: d.
        vocab_rows: V_d, the head's output rows (the draft vocabulary).
        rank: r, 1 <= r <= min(V_d, d).
        dtype: parameter dtype.

    Raises:
        ValueError: if rank is outside [1, min(V_d, d)].
    """

    def __init__(
        self, hidden_size: int, vocab_rows: int, rank: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        if not 1 <= rank <= min(hidden_size, vocab_rows):
            raise ValueError(f"rank r={rank} is outside [1, min(V_d={vocab_rows}, d={hidden_size})]")
        self.down = nn.Linear(hidden_size, rank, bias=False, dtype=dtype)  # W_down [r, d]
        self.up = nn.Linear(rank, vocab_rows, bias=False, dtype=dtype)  # W_up [V_d, r]
        self._rerank: tuple[int, nn.Embedding] | None = None  # a tuple: not a registered submodule
        self.rerank_context = 0  # most distinct context tokens rescored with the rerank, 0 = none

    @property
    def rerank_k(self) -> int:
        """k of the shortlist rerank, 0 when off."""
        return self._rerank[0] if self._rerank is not None else 0

    def set_rerank(self, k: int, rows: nn.Embedding | None, context: int = 0) -> None:
        """Rescore the top ``k`` low-rank logits with the full-rank rows of ``rows`` (eval mode only).

        ``rows.weight`` [V_d, d] must hold the dense head the factors approximate: for a drafter
        whose lm_head is the (tied, frozen) target embedding, its own ``embed_tokens``. The rows
        are referenced, not copied or saved; ``k = 0`` turns the rerank off. ``context`` > 0 asks
        the decoder to pass up to that many distinct tokens of the sequence (the most recent) to
        :meth:`forward`, which rescores them too.

        Raises:
            ValueError: k outside [0, V_d], context < 0, or rows of another shape than [V_d, d].
        """
        if not 0 <= k <= self.out_features:
            raise ValueError(f"rerank k={k} is outside [0, V_d={self.out_features}]")
        if context < 0:
            raise ValueError(f"rerank context={context}: expected >= 0 (0 = no context pool)")
        if k == 0 or rows is None:
            self._rerank, self.rerank_context = None, 0
            return
        shape = tuple(rows.weight.shape)
        if shape != (self.out_features, self.in_features):
            raise ValueError(
                f"rerank rows have shape {list(shape)}, expected [V_d, d] = "
                f"[{self.out_features}, {self.in_features}]"
            )
        self._rerank, self.rerank_context = (k, rows), context

    @property
    def rank(self) -> int:
        """r."""
        return self.down.out_features

    @property
    def out_features(self) -> int:
        """V_d (same attribute name as ``nn.Linear``)."""
        return self.up.out_features

    @property
    def in_features(self) -> int:
        """d."""
        return self.down.in_features

    def context_rows(self, context_ids: Tensor) -> Tensor | None:
        """The full-rank rows of a context pool, gathered once per round for :meth:`forward`.

        Args:
            context_ids: [B, C] int64 target ids (a row may repeat an id as padding).

        Returns:
            [B, C, d] rows, or None while the rerank is off.
        """
        return None if self._rerank is None else self._rerank[1].weight[context_ids]

    def forward(self, hidden: Tensor, context: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Logits of the normed hidden state.

        Args:
            hidden: [..., d]; with ``context``, [B, ..., d].
            context: (ids [B, C] int64, rows [B, C, d] from :meth:`context_rows`): tokens of each
                batch row's sequence, rescored exactly as well (ignored while the rerank is off).

        Returns:
            [..., V_d] in the parameters' dtype; with the rerank on (eval mode), the top-k
            entries of the low-rank logits (and the context tokens) replaced by their exact
            full-rank scores.

        Raises:
            ValueError: ``context`` ids and rows of mismatched or wrong shapes.
        """
        z = self.up(self.down(hidden))  # [..., r] -> [..., V_d]
        if self._rerank is None or self.training:
            return z
        k, rows = self._rerank
        idx = block_topk(z, k)[1]  # [..., k], torch.topk's entries (vocab_pick.py)
        w = rows.weight[idx].to(hidden.dtype)  # [..., k, d]
        exact = torch.matmul(w, hidden.unsqueeze(-1)).squeeze(-1)  # [..., k]
        z = z.scatter(-1, idx, exact.to(z.dtype))
        if context is None:
            return z
        ids, crow = context
        B = hidden.shape[0] if hidden.dim() > 1 else 0
        if ids.dim() != 2 or ids.shape[0] != B or crow.shape != (*ids.shape, self.in_features):
            raise ValueError(
                f"rerank context ids {list(ids.shape)} and rows {list(crow.shape)} for hidden "
                f"{list(hidden.shape)}: expected [B, C] and [B, C, d] with B = hidden.shape[0]"
            )
        flat = hidden.reshape(B, -1, hidden.shape[-1])  # [B, M, d]
        exact_c = torch.matmul(flat, crow.to(hidden.dtype).transpose(1, 2))  # [B, M, C]
        zf = z.reshape(B, flat.shape[1], -1)
        zf = zf.scatter(-1, ids[:, None].expand(-1, flat.shape[1], -1), exact_c.to(z.dtype))
        return zf.reshape(z.shape)

    @classmethod
    def from_factorization(cls, fac: Factorization) -> LowRankHead:
        """Build a head holding ``fac.W_up`` and ``fac.W_down`` (copied, dtype kept)."""
        V_d, r = fac.W_up.shape
        head = cls(fac.W_down.shape[1], V_d, r, dtype=fac.W_up.dtype)
        with torch.no_grad():
            head.up.weight.copy_(fac.W_up)
            head.down.weight.copy_(fac.W_down)
        return head


def make_head(
    hidden_size: int, vocab_rows: int, rank: int | None, dtype: torch.dtype | None = None
) -> nn.Module:
    """A dense ``nn.Linear(d, V_d, bias=False)`` when rank is None, else a :class:`LowRankHead`."""
    if rank is None:
        return nn.Linear(hidden_size, vocab_rows, bias=False, dtype=dtype)
    return LowRankHead(hidden_size, vocab_rows, rank, dtype=dtype)


def head_rank(head: nn.Module) -> int | None:
    """r of a :class:`LowRankHead`, None for a dense head."""
    return head.rank if isinstance(head, LowRankHead) else None
