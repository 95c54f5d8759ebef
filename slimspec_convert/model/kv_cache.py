"""The drafter's own KV cache (one decoder layer; crop and row selection for batches)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class DraftKVCache:
    """Per-layer key/value tensors of the drafter, [B, H_kv, S, head_dim] each.

    ``S`` is the number of cached positions; the caller tracks which of them a query may see
    (through the attention mask) and trims or gathers them after verification.
    """

    keys: list[Tensor | None] = field(default_factory=list)
    values: list[Tensor | None] = field(default_factory=list)

    def length(self, layer: int = 0) -> int:
        """S, the number of positions cached for ``layer`` (0 when it has none yet).

        Within one forward of a multi-layer drafter, layer 0 is updated before layer 1 reads its
        own past, so a layer must ask for its own length.
        """
        if layer >= len(self.keys) or self.keys[layer] is None:
            return 0
        return int(self.keys[layer].shape[2])

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append [B, H_kv, T, hd] keys/values for ``layer``; return the full cached tensors."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer."""
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]

    def gather(self, index: Tensor) -> None:
        """Keep positions ``index`` ([B, S'] int64, per row) of every layer, in that order."""
        for i, k in enumerate(self.keys):
            if k is None:
                continue
            idx = index[:, None, :, None].expand(k.shape[0], k.shape[1], index.shape[1], k.shape[3])
            self.keys[i] = torch.gather(k, 2, idx)
            self.values[i] = torch.gather(self.values[i], 2, idx)

    def detach(self) -> None:
        """Drop autograd history (used between training-time-test unrolls of different batches)."""
        self.keys = [k.detach() if k is not None else None for k in self.keys]
        self.values = [v.detach() if v is not None else None for v in self.values]
