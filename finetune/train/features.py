"""Target features computed once and kept on disk: ``--feature-cache DIR`` (finetune, train-drafter).

A training step needs, for every example, the target's aux hidden states (the drafter's input) and
its final hidden states (whose head product is the KL reference). They depend only on the frozen
target and the example's tokens, so a run that passes over its data more than once (or several runs
on the same data: a sweep, a resumed run) computes them once. SpecForge's offline mode and EAGLE's
``ge_data`` scripts do the same; the folder holds:

* ``features.json``: what the features are of (target config hash, aux boundaries, stored dtype)
  and which shard holds each example (keyed by the SHA-256 of its token ids);
* ``shard-NNNNN.safetensors``: per example ``{key}.aux`` [T, K*dt] and ``{key}.final`` [T, dt], in
  bfloat16 (half the bytes; the rounding, 2^-9 relative, is below the spread between a float32 and
  a bfloat16 target), and ``{key}.lse`` [T] float32, the log-normaliser ``logsumexp`` of the target's
  logits on the stored final states: with it, ``--loss-vocab N`` needs the target's head product on
  its N rows only (``loss.reference_rows_from_logp``), not on all V (Gemma 3: 262,144) rows.

Every shard is written atomically and the manifest after it, so a killed build keeps what it wrote
and the next run computes only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from finetune.train.loss import reference_rows_from_logp
from slimspec_convert.atomic import atomic_path, atomic_write_json
from slimspec_convert.data.distill import target_fingerprint
from slimspec_convert.data.examples import Example, collate
from slimspec_convert.targets.forward import TargetOutput, target_forward, target_logits_at

logger = logging.getLogger(__name__)

MANIFEST = "features.json"
STORED_DTYPE = torch.bfloat16


def example_key(example: Example) -> str:
    """SHA-256 (first 24 hex digits) of the example's int64 token ids."""
    return hashlib.sha256(example.input_ids.to(torch.int64).numpy().tobytes()).hexdigest()[:24]


def _weights_fingerprint(model) -> str:
    """SHA-256 (16 hex digits) of the first 4096 values of every parameter: tells fine-tunes of one
    architecture apart (the config hash does not)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class FeatureCache:
    """The target's aux and final hidden states of a set of examples, in a folder.

    Args:
        folder: where the manifest and shards live (created).
        target: the HF target (eval mode), used only by :meth:`build`.
        aux_layers: boundary ids the drafter reads (ascending).
        pad_id: padding token id for the build batches.
        batch_tokens: padded tokens per target forward of the build.
        shard_examples: examples per shard file.
        logits_fn: final hidden states [N, dt] float32 -> the target's logits [N, V] float32, in the
            products' dtype of training (default :func:`target_logits_at`), for ``{key}.lse``.

    Raises:
        ValueError: the folder holds features of another target or other aux layers.
    """

    def __init__(
        self,
        folder: str | Path,
        target,
        aux_layers: tuple[int, ...],
        pad_id: int,
        batch_tokens: int = 8192,
        shard_examples: int = 256,
        logits_fn: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.logits_fn = logits_fn or (lambda x: target_logits_at(target, x))
        self.target = target
        self.aux_layers = tuple(sorted(aux_layers))
        self.pad_id = pad_id
        self.batch_tokens = batch_tokens
        self.shard_examples = shard_examples
        self.context = {
            "target": target_fingerprint(target, None)[0],
            "weights": _weights_fingerprint(target),
            "aux_layers": list(self.aux_layers),
            "dtype": str(STORED_DTYPE).removeprefix("torch."),
        }
        self.index: dict[str, str] = {}
        path = self.folder / MANIFEST
        if path.is_file():
            try:
                manifest = json.loads(path.read_text())
                found = {k: manifest[k] for k in self.context}
                self.index = dict(manifest["shards"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: not a feature-cache manifest ({e}); use an empty folder") from e
            if found != self.context:
                raise ValueError(
                    f"{path}: features of {found}, but this run needs {self.context} (another target or "
                    "aux layers); use another --feature-cache folder"
                )
        self._keys: dict[int, str] = {}
        self._open: dict[str, object] = {}
        self._shard_keys: dict[str, set[str]] = {}
        self._rows: Tensor | None = None  # the target head's --loss-vocab rows, in the products' dtype

    def key(self, example: Example) -> str:
        k = self._keys.get(id(example))
        if k is None:
            k = self._keys[id(example)] = example_key(example)
        return k

    def missing(self, examples: list[Example]) -> list[Example]:
        """The examples (one per distinct key) whose features are not stored yet."""
        seen, out = set(self.index), []
        for e in examples:
            k = self.key(e)
            if k not in seen:
                seen.add(k)
                out.append(e)
        return out

    @torch.no_grad()
    def build(self, examples: list[Example]) -> int:
        """Compute and store the features of every example not stored yet; returns how many were added."""
        from tqdm.auto import tqdm

        todo = sorted(self.missing(examples), key=lambda e: e.input_ids.numel())
        if not todo:
            return 0
        self.folder.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=len(todo), desc="target features", unit="example")
        n_shard = len({v for v in self.index.values()})
        for i in range(0, len(todo), self.shard_examples):
            chunk = todo[i : i + self.shard_examples]
            tensors: dict[str, Tensor] = {}
            j = 0
            while j < len(chunk):  # length-sorted: batches of about batch_tokens padded tokens
                n = max(1, self.batch_tokens // chunk[min(len(chunk) - 1, j)].input_ids.numel())
                part = chunk[j : j + n]
                longest = max(e.input_ids.numel() for e in part)
                while len(part) > 1 and len(part) * longest > self.batch_tokens:
                    part = part[:-1]
                    longest = max(e.input_ids.numel() for e in part)
                batch = collate(part, self.pad_id)
                dev = next(self.target.parameters()).device
                out = target_forward(
                    self.target,
                    batch["input_ids"].to(dev),
                    self.aux_layers,
                    attention_mask=batch["attention_mask"].to(dev),
                    logits_to_keep=1,
                )
                for r, e in enumerate(part):
                    t = e.input_ids.numel()
                    k = self.key(e)
                    tensors[f"{k}.aux"] = out.aux_hidden[r, :t].to(STORED_DTYPE).cpu().contiguous()
                    final = out.final_hidden[r, :t].to(STORED_DTYPE)
                    tensors[f"{k}.final"] = final.cpu().contiguous()
                    tensors[f"{k}.lse"] = self._lse(final.float()).cpu().contiguous()
                j += len(part)
                bar.update(len(part))
            name = f"shard-{n_shard:05d}.safetensors"
            n_shard += 1
            from safetensors.torch import save_file

            with atomic_path(self.folder / name) as tmp:
                save_file(tensors, str(tmp))
            for e in chunk:
                self.index[self.key(e)] = name
            atomic_write_json(self.folder / MANIFEST, {**self.context, "shards": self.index})
        bar.close()
        return len(todo)

    @torch.no_grad()
    def loss_vocab_reference(
        self, out: TargetOutput, where: Tensor, ids: Tensor, dtype: torch.dtype, temperature: float = 1.0
    ):
        """The ``--loss-vocab`` reference from the stored log-normaliser: ``logits[:, ids] - lse``, so
        the target's head product runs on the ``ids`` rows only.

        With ``--teacher-temperature`` T != 1 the reference is ``logits[:, ids] / T - lse_T``. The
        stored ``lse`` is T = 1's, so ``lse_T`` is rebuilt from the ``ids`` rows and the T = 1 mass
        outside them, ``m_out = 1 - sum(softmax(logits)[ids])``, taken as spread evenly over the
        other ``V - n`` rows: ``lse_T = logaddexp(logsumexp(logits[:, ids] / T),
        (log(m_out) + lse) / T + (1 - 1/T) log(V - n))``. Exact at T = 1 and when ``ids`` is the
        whole vocabulary; for T < 1 the even spread is the smallest possible tail (power means), so
        the ``ids`` probabilities are at least the exact ones and at most the ``ids``-renormalised
        ones. On a large vocabulary (Gemma 3: 229k rows outside a 32k loss vocabulary) the sharpened
        tail is negligible either way.

        Args:
            out: :meth:`target_output` of the batch (``final_lse`` set).
            where: [B, T] bool positions whose reference is needed.
            ids: [n] int64 target ids (``Trainer.loss_ids``).
            dtype: the head products' dtype (the trainer's: bfloat16 on CPUs with bf16 units).
            temperature: T > 0 of the reference ``softmax(logits / T)``.

        Returns:
            ``loss.ReferenceRows`` over the ``ids`` rows.
        """
        w = self.target.get_output_embeddings().weight
        if self._rows is None or self._rows.dtype != dtype or self._rows.shape[0] != ids.numel():
            self._rows = w.detach().index_select(0, ids).to(dtype)
        rows = self._rows
        b, t = where.nonzero(as_tuple=True)
        logits = target_logits_at(
            self.target, out.final_hidden[b, t], head=lambda x: F.linear(x.to(dtype), rows)
        )
        lse = out.final_lse[b, t, None]
        if temperature == 1.0:
            return reference_rows_from_logp(logits - lse, where)  # float32 (lse's), one [M, n] tensor
        logits = logits.float()
        log_in = (logits - lse).logsumexp(-1, keepdim=True).clamp_max(0.0)  # log sum_ids p, T = 1
        log_out = torch.log(-torch.expm1(log_in)).clamp_min(-1e4)  # log m_out (-1e4: nothing outside)
        n_out = max(w.shape[0] - ids.numel(), 1)
        log_tail = (log_out + lse) / temperature + (1 - 1 / temperature) * math.log(n_out)
        lse_t = torch.logaddexp((logits / temperature).logsumexp(-1, keepdim=True), log_tail)
        return reference_rows_from_logp(logits / temperature - lse_t, where)

    def _lse(self, final: Tensor, chunk: int = 64) -> Tensor:
        """[T] float32 logsumexp of the target's logits at stored final states [T, dt], ``chunk`` rows
        at a time (a [T, V] block of 262k-row logits would not fit in cache or, for long T, memory)."""
        return torch.cat(
            [self.logits_fn(final[s : s + chunk]).logsumexp(-1) for s in range(0, len(final), chunk)]
        )

    def _tensor(self, name: str, shard: str) -> Tensor:
        return self._tensor_file(shard).get_tensor(name)

    def _tensor_file(self, shard: str):
        from safetensors import safe_open

        f = self._open.get(shard)
        if f is None:
            f = self._open[shard] = safe_open(str(self.folder / shard), framework="pt")
        return f

    def target_output(self, examples: list[Example], device: torch.device) -> TargetOutput:
        """The stored features of a batch, right-padded as :func:`collate` pads the tokens.

        Returns:
            :class:`TargetOutput` with ``aux_hidden`` [B, T, K*dt] and ``final_hidden`` [B, T, dt]
            float32 (``logits`` empty), and ``final_lse`` [B, T] float32 when every example has one
            stored (caches built before it was stored have none).

        Raises:
            KeyError: an example whose features were never built (naming the folder).
        """
        T = max(e.input_ids.numel() for e in examples)
        aux, final = None, None
        lse: Tensor | None = torch.zeros(len(examples), T)
        for r, e in enumerate(examples):
            k = self.key(e)
            shard = self.index.get(k)
            if shard is None:
                raise KeyError(f"{self.folder}: no features for an example of this batch (build first)")
            a, f = self._tensor(f"{k}.aux", shard), self._tensor(f"{k}.final", shard)
            if aux is None:
                aux = torch.zeros(len(examples), T, a.shape[-1])
                final = torch.zeros(len(examples), T, f.shape[-1])
            aux[r, : a.shape[0]] = a.float()
            final[r, : f.shape[0]] = f.float()
            if lse is not None and f"{k}.lse" in self._keys_of(shard):
                lse[r, : f.shape[0]] = self._tensor(f"{k}.lse", shard)
            else:
                lse = None
        return TargetOutput(
            logits=torch.empty(0),
            aux_hidden=aux.to(device),
            final_hidden=final.to(device),
            final_lse=None if lse is None else lse.to(device),
        )

    def _keys_of(self, shard: str) -> set[str]:
        keys = self._shard_keys.get(shard)
        if keys is None:
            self._tensor_file(shard)
            keys = self._shard_keys[shard] = set(self._open[shard].keys())
        return keys
