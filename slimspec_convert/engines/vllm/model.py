"""vLLM model class for SlimSpec low-rank EAGLE-3 drafters (imported by vLLM, never by the library).

:class:`SlimSpecEagle3LlamaForCausalLM` is vLLM 0.32's ``Eagle3LlamaForCausalLM``
(``vllm/model_executor/models/llama_eagle3.py``) with one change: the dense
``ParallelLMHead(draft_vocab_size, hidden_size)`` is replaced by :class:`LowRankParallelLMHead`,
``z = W_up (W_down h)`` (SlimSpec eq. 1). The dense ``V_d x d`` head is never built: ``__init__``
repeats the parent's (same attribute names, so vLLM's proposer, weight loader and aux-state plumbing
work unchanged) instead of calling it.

* It subclasses ``Eagle3LlamaForCausalLM``, so the proposer's ``isinstance`` check in ``propose()``
  (``vllm/v1/spec_decode/llm_base_proposer.py``) passes.
* ``W_down`` [r, d] is a replicated linear; ``W_up`` [V_d, r] is a ``ParallelLMHead`` of width r,
  sharded over the vocabulary like vLLM's own heads, so ``LogitsProcessor`` gathers the shards (and
  drops the vocabulary padding) exactly as for a dense head; ``get_top_tokens`` reduces local argmaxes.
* The head is the drafter's own: the loader marks ``has_own_lm_head`` from the ``lm_head.*`` keys and
  the module has no ``weight`` for ``_maybe_share_lm_head`` to compare, so vLLM keeps it (and
  :meth:`load_weights` refuses a file without the factors instead of serving an empty head).
* A trimmed draft vocabulary uses vLLM's ``draft_id_to_target_id`` (the file's ``d2t``), as the parent.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.utils import maybe_prefix

from slimspec_convert.checkpoint.names import LM_HEAD_DOWN_KEY, LM_HEAD_UP_KEY

RANK_FIELD = "lm_head_rank"  # config.json: r, written by `slimspec convert` (checkpoint/save.py)


class LowRankParallelLMHead(nn.Module):
    """``W_up (W_down h)`` with ``W_up`` sharded over the vocabulary (tensor parallelism).

    Parameter names give the checkpoint keys ``lm_head.down.weight`` [r, d] and
    ``lm_head.up.weight`` [V_d, r]. ``forward`` applies ``W_down`` only; the vocabulary projection
    runs in vLLM's ``LogitsProcessor`` on :attr:`up`, which shards, gathers and trims padding.

    Args:
        hidden_size: d.
        vocab_rows: V_d, the draft vocabulary.
        rank: r, 1 <= r <= min(V_d, d).
        prefix: vLLM module prefix (``lm_head``).

    Raises:
        ValueError: rank outside [1, min(V_d, d)].
    """

    def __init__(self, hidden_size: int, vocab_rows: int, rank: int, prefix: str = "") -> None:
        super().__init__()
        if not 1 <= rank <= min(hidden_size, vocab_rows):
            raise ValueError(
                f"config.json: {RANK_FIELD}={rank} is outside [1, min(draft_vocab_size={vocab_rows}, "
                f"hidden_size={hidden_size})]"
            )
        self.rank = rank
        self.down = ReplicatedLinear(
            hidden_size,
            rank,
            bias=False,
            return_bias=False,
            disable_tp=True,
            prefix=maybe_prefix(prefix, "down"),
        )
        self.up = ParallelLMHead(vocab_rows, rank, prefix=maybe_prefix(prefix, "up"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``W_down h``: [..., d] -> [..., r], in the parameters' dtype."""
        return self.down(hidden_states)


class SlimSpecEagle3LlamaForCausalLM(Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 Llama drafter with a low-rank head (see the module docstring).

    Args:
        vllm_config: vLLM's config; the drafter's ``config.json`` is
            ``vllm_config.speculative_config.draft_model_config.hf_config`` and must carry
            ``lm_head_rank``.
        prefix: vLLM module prefix.

    Raises:
        ValueError: no ``lm_head_rank`` in config.json, or a rank outside [1, min(V_d, d)].
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)  # not Eagle3LlamaForCausalLM.__init__: it allocates the dense head
        speculative_config = vllm_config.speculative_config
        assert speculative_config is not None
        self.config = speculative_config.draft_model_config.hf_config
        rank = getattr(self.config, RANK_FIELD, None)
        if rank is None:
            raise ValueError(
                f"config.json of {speculative_config.model}: no '{RANK_FIELD}'; the slimspec architecture "
                "needs a low-rank head (write the folder with `slimspec convert`)"
            )
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        target_layer_num = vllm_config.model_config.get_total_num_hidden_layers()
        self.config.target_layer_count = target_layer_num
        self.model = LlamaModel(
            vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), start_layer_id=target_layer_num
        )
        self.lm_head = LowRankParallelLMHead(
            self.config.hidden_size, self.config.draft_vocab_size, int(rank), maybe_prefix(prefix, "lm_head")
        )
        self.logits_processor = LogitsProcessor(
            self.config.draft_vocab_size, scale=getattr(self.config, "logit_scale", 1.0)
        )
        if self.config.draft_vocab_size != vllm_config.model_config.get_vocab_size():
            self.draft_id_to_target_id = nn.Parameter(
                torch.zeros(self.config.draft_vocab_size, dtype=torch.long), requires_grad=False
            )
        else:
            self.draft_id_to_target_id = None
        self.use_parallel_drafting = speculative_config.parallel_drafting
        if self.use_parallel_drafting:
            self.register_buffer("mask_hidden", torch.zeros(1, self.model.fc_input_size), persistent=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Low-rank logits over the target vocabulary.

        Args:
            hidden_states: [N, d] drafter states after the final norm.

        Returns:
            [N, V_t] logits; with a trimmed draft vocabulary the rows outside it are -inf.
        """
        logits = self.logits_processor(self.lm_head.up, self.lm_head(hidden_states))  # [N, V_d]
        if logits is None or self.draft_id_to_target_id is None:
            return logits
        base = torch.arange(self.config.draft_vocab_size, device=logits.device)
        targets = base + self.draft_id_to_target_id  # [V_d] target ids i + d2t[i]
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, targets] = logits
        return full

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens without gathering the logits (vLLM's local argmax reduction).

        Args:
            hidden_states: [N, d] drafter states after the final norm.

        Returns:
            [N] int64 target-vocabulary ids (``i + d2t[i]`` for a trimmed vocabulary).
        """
        top = self.logits_processor.get_top_tokens(self.lm_head.up, self.lm_head(hidden_states))
        if self.draft_id_to_target_id is not None:
            top = top + self.draft_id_to_target_id[top]
        return top

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The parent's loader, refusing a file without both factors of the head.

        Raises:
            ValueError: ``lm_head.down.weight`` or ``lm_head.up.weight`` is not in the file.
        """
        seen: set[str] = set()

        def record(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                seen.add(name.removeprefix("model."))
                yield name, tensor

        super().load_weights(record(weights))
        missing = [k for k in (LM_HEAD_DOWN_KEY, LM_HEAD_UP_KEY) if k not in seen]
        if missing:
            raise ValueError(
                f"weights of {self.config.architectures}: no {missing}; a low-rank drafter stores both "
                "factors of its head (write the folder with `slimspec convert`)"
            )
        self.has_own_lm_head = True
