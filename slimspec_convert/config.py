"""Frozen configuration dataclasses; every default of the package is defined here once.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the field
and the value it saw (STYLE.md section 4).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Defaults (one place).
DEFAULT_RANK_DIVISOR = 8  # r = d / 8, the paper's default (SlimSpec section 4)
DEFAULT_EXACT_SVD_MAX_ELEMENTS = 64 * 1024 * 1024  # larger heads use randomized SVD
DEFAULT_EXACT_SVD_MAX_SIDE = 2048  # float64 eigh of a [m, m] Gram matrix; m = 4096 takes ~45 s on 2 cores
DEFAULT_RANDOMIZED_OVERSAMPLE = 32
DEFAULT_RANDOMIZED_NITER = 1  # extra block-Krylov blocks (factorize.lowrank_factorize); 1 -> <= 2 % excess
DEFAULT_CALIBRATION_DAMP = 0.01  # calibrated_factorize: lambda = damp * mean eigenvalue of E[h h^T]
DEFAULT_ROPE_THETA = 10000.0  # EAGLE / SpecForge drafters omit rope_theta (eagle3-formats.md P15)
DEFAULT_RMS_NORM_EPS = 1e-5

AUX_CONVENTION_BOUNDARY = "boundary"  # residual stream after b decoder blocks (vLLM, speculators)
AUX_CONVENTION_OUTPUT_OF = "output_of_layer"  # block o's output, b = o + 1 (SpecForge, SGLang, ModelOpt)


def default_aux_boundaries(num_target_layers: int) -> tuple[int, int, int]:
    """Upstream default capture boundaries {2, L//2, L-3} (eagle3-formats.md section 6).

    Args:
        num_target_layers: L, the target's number of decoder layers (>= 6).

    Returns:
        Three ascending boundary indices.

    Raises:
        ValueError: if L < 6 (the three boundaries would collide).
    """
    if num_target_layers < 6:
        raise ValueError(f"num_target_layers={num_target_layers}: need >= 6 for the default aux layers")
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class DrafterConfig:
    """Normalised geometry and flags of an EAGLE-3 drafter, whatever dialect it was read from.

    The field names follow Hugging Face's LlamaConfig where one exists. ``aux_layer_ids`` are
    always stored as *boundary* indices (eagle3-formats.md section 6); ``aux_layer_ids_source``
    records what the checkpoint declared, for round trips.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    head_dim: int | None = None
    num_hidden_layers: int = 1
    target_hidden_size: int | None = None
    num_aux_hidden_states: int = 3
    aux_layer_ids: tuple[int, ...] | None = None
    aux_layer_ids_source: str = AUX_CONVENTION_BOUNDARY
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    fc_bias: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output_postnorm: bool = False  # recurrence feeds norm(h) (EAGLE 3.1) instead of h
    has_final_norm: bool = True
    use_aux_hidden_state: bool = True
    head_rank: int | None = None  # None: dense lm_head; int: low-rank W_up @ W_down
    source_format: str = "slimspec"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "draft_vocab_size",
            "num_hidden_layers",
            "num_aux_hidden_states",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DrafterConfig.{name}={value!r}: expected a positive integer")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"DrafterConfig.draft_vocab_size={self.draft_vocab_size} > vocab_size={self.vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"DrafterConfig.head_dim missing and hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("DrafterConfig: norm_before_fc and fc_norm are mutually exclusive")
        max_rank = min(self.draft_vocab_size, self.hidden_size)
        if self.head_rank is not None and not 1 <= self.head_rank <= max_rank:
            raise ValueError(
                f"DrafterConfig.head_rank={self.head_rank}: expected 1 <= r <= "
                f"min(draft_vocab_size={self.draft_vocab_size}, hidden_size={self.hidden_size})"
            )
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(sorted(int(i) for i in self.aux_layer_ids)))
            if len(self.aux_layer_ids) != self.num_aux_hidden_states:
                raise ValueError(
                    f"DrafterConfig.aux_layer_ids={list(self.aux_layer_ids)} has "
                    f"{len(self.aux_layer_ids)} ids, expected "
                    f"num_aux_hidden_states={self.num_aux_hidden_states}"
                )

    @property
    def resolved_head_dim(self) -> int:
        """head_dim, or d / H when the config omits it (eagle3-formats.md P16)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def resolved_target_hidden_size(self) -> int:
        """dt, the target's hidden width (defaults to d)."""
        return self.target_hidden_size if self.target_hidden_size is not None else self.hidden_size

    @property
    def is_trimmed(self) -> bool:
        """True when the draft vocabulary is smaller than the target's (a ``d2t`` map is needed)."""
        return self.draft_vocab_size < self.vocab_size

    def resolved_aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """Boundary indices to capture from a target with ``num_target_layers`` layers."""
        if self.aux_layer_ids is not None:
            for b in self.aux_layer_ids:
                if not 0 <= b <= num_target_layers:
                    raise ValueError(
                        f"aux layer boundary {b} outside [0, {num_target_layers}] for this target"
                    )
            return self.aux_layer_ids
        return default_aux_boundaries(num_target_layers)

    def replace(self, **changes: Any) -> DrafterConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        out = dataclasses.asdict(self)
        if out["aux_layer_ids"] is not None:
            out["aux_layer_ids"] = list(out["aux_layer_ids"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"DrafterConfig: unknown fields {unknown}")
        return cls(**data)


@dataclass(frozen=True)
class ConvertConfig:
    """Options of ``slimspec convert`` (exactly one of rank, rank_fraction, energy may be set).

    With none set, the rank is ``hidden_size // DEFAULT_RANK_DIVISOR`` (r = d/8).
    """

    rank: int | None = None
    rank_fraction: float | None = None
    energy: float | None = None
    full_vocab: bool = False
    target: str | None = None
    dtype: str | None = None
    force: bool = False
    svd: str = "auto"  # auto | exact | randomized
    seed: int = 0
    svd_niter: int = DEFAULT_RANDOMIZED_NITER
    norm_output_semantics: str = "auto"  # auto | specforge | engine (eagle3-formats.md P7)
    calibration_damp: float = DEFAULT_CALIBRATION_DAMP

    def __post_init__(self) -> None:
        chosen = [n for n in ("rank", "rank_fraction", "energy") if getattr(self, n) is not None]
        if len(chosen) > 1:
            raise ValueError(f"ConvertConfig: give only one of rank, rank_fraction, energy (got {chosen})")
        if self.rank is not None and self.rank <= 0:
            raise ValueError(f"ConvertConfig.rank: rank r={self.rank} must be >= 1")
        if self.rank_fraction is not None and not 0 < self.rank_fraction <= 1:
            raise ValueError(f"ConvertConfig.rank_fraction={self.rank_fraction}: expected 0 < F <= 1")
        if self.energy is not None and not 0 < self.energy <= 1:
            raise ValueError(f"ConvertConfig.energy={self.energy}: expected 0 < E <= 1")
        if self.full_vocab and not self.target:
            raise ValueError("ConvertConfig.full_vocab needs target (--target): rows come from its lm_head")
        if self.svd not in ("auto", "exact", "randomized"):
            raise ValueError(f"ConvertConfig.svd={self.svd!r}: expected auto, exact or randomized")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"ConvertConfig.dtype={self.dtype!r}: expected one of {sorted(DTYPES)}")
        if self.energy is not None and self.svd == "randomized":
            raise ValueError("ConvertConfig: energy needs the full spectrum; use svd='exact' or 'auto'")
        if not self.calibration_damp > 0:
            raise ValueError(f"ConvertConfig.calibration_damp={self.calibration_damp}: expected > 0")
        if self.svd_niter < 0:
            raise ValueError(f"ConvertConfig.svd_niter={self.svd_niter}: expected >= 0")
        if self.norm_output_semantics not in NORM_OUTPUT_SEMANTICS:
            raise ValueError(
                f"ConvertConfig.norm_output_semantics={self.norm_output_semantics!r}: "
                f"expected one of {list(NORM_OUTPUT_SEMANTICS)}"
            )


NORM_OUTPUT_SEMANTICS = ("auto", "specforge", "engine")

DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


@dataclass(frozen=True)
class DraftConfig:
    """How the drafter proposes tokens each round (EAGLE-2/3 dynamic tree, or a chain).

    ``depth`` draft steps; tree drafting expands the ``top_k`` best nodes per step and keeps the
    ``total_tokens`` best by cumulative log-probability (EAGLE's ``total_token`` minus the root).
    CPU defaults were chosen by measurement (PAPER.md: a 60-token tree costs 3x a 1-token step).
    """

    method: str = "tree"
    depth: int = 5
    top_k: int = 4
    total_tokens: int = 16

    def __post_init__(self) -> None:
        if self.method not in ("tree", "chain"):
            raise ValueError(f"DraftConfig.method={self.method!r}: expected tree or chain")
        if self.depth < 1:
            raise ValueError(f"DraftConfig.depth={self.depth}: expected >= 1")
        if self.top_k < 1:
            raise ValueError(f"DraftConfig.top_k={self.top_k}: expected >= 1")
        if self.total_tokens < 1:
            raise ValueError(f"DraftConfig.total_tokens={self.total_tokens}: expected >= 1")


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding: temperature 0 is greedy; otherwise lossless speculative sampling with top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature}: expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p}: expected 0 < P <= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens}: expected >= 1")


# ---- benchmarks, trimming, rank sweep (issue 5) ------------------------------------------------
# The paper's three target shapes (drafter hidden size d, vocabulary V), SlimSpec section 5.
PAPER_HEAD_SHAPES: dict[str, tuple[int, int]] = {
    "Llama-3.1-8B": (4096, 128256),
    "gpt-oss-20b": (2880, 201088),
    "Qwen3-30B-A3B": (2048, 151936),
}
DEFAULT_BENCH_RANK_DIVISORS = (8, 16)  # r = d/8 (paper default) and d/16
DEFAULT_BENCH_BATCH_SIZES = (1, 64)
DEFAULT_BENCH_DTYPE = "bfloat16"
DEFAULT_TRIMMED_ROWS = 32000  # EAGLE-3's 32k draft vocabulary
DEFAULT_BENCH_WARMUP = 1  # interleaved warm-up rounds before timing
DEFAULT_BENCH_REPEATS = 15  # at most this many interleaved timed rounds ...
DEFAULT_BENCH_MIN_REPEATS = 3  # ... and at least this many, whatever the time budget
DEFAULT_BENCH_BUDGET_S = 20.0  # timed seconds per (shape, batch size, dtype) before repeats are capped
DEFAULT_SWEEP_RANK_DIVISORS = (32, 16, 8, 4, 2)  # ranks d/32 ... d/2
DEFAULT_SWEEP_MAX_EXAMPLES = 32
DEFAULT_SWEEP_MAX_LENGTH = 256
DEFAULT_SWEEP_BATCH_SIZE = 4
DEFAULT_NUM_DRAFT_TOKENS = 5  # k of the chain model used to turn acceptance into tau (= DraftConfig.depth)
DEFAULT_TRIM_MAX_LENGTH = 2048


def _check_dtype(owner: str, dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"{owner}.dtype={dtype!r}: expected one of {sorted(DTYPES)}")


@dataclass(frozen=True)
class BenchHeadConfig:
    """Options of ``slimspec bench head``: which head shapes, ranks and batch sizes to time.

    ``ranks`` entries are absolute ranks (int) or ``"d/N"`` strings resolved per shape.
    """

    shapes: tuple[tuple[int, int], ...] = tuple(PAPER_HEAD_SHAPES.values())
    ranks: tuple[int | str, ...] = tuple(f"d/{n}" for n in DEFAULT_BENCH_RANK_DIVISORS)
    batch_sizes: tuple[int, ...] = DEFAULT_BENCH_BATCH_SIZES
    dtype: str = DEFAULT_BENCH_DTYPE
    trimmed_rows: int = DEFAULT_TRIMMED_ROWS
    warmup: int = DEFAULT_BENCH_WARMUP
    repeats: int = DEFAULT_BENCH_REPEATS
    min_repeats: int = DEFAULT_BENCH_MIN_REPEATS
    budget_s: float = DEFAULT_BENCH_BUDGET_S
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("BenchHeadConfig.shapes is empty: give at least one (hidden_size, vocab_size)")
        for d, v in self.shapes:
            if d < 1 or v < 1:
                raise ValueError(f"BenchHeadConfig.shapes: (hidden_size={d}, vocab_size={v}): must be > 0")
        if not self.ranks:
            raise ValueError("BenchHeadConfig.ranks is empty")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"BenchHeadConfig.batch_sizes={self.batch_sizes}: expected positive integers")
        _check_dtype("BenchHeadConfig", self.dtype)
        if self.trimmed_rows < 0:
            raise ValueError(f"BenchHeadConfig.trimmed_rows={self.trimmed_rows}: expected >= 0 (0 = skip)")
        if self.warmup < 0 or self.min_repeats < 1 or self.repeats < self.min_repeats:
            raise ValueError(
                f"BenchHeadConfig: warmup={self.warmup}, min_repeats={self.min_repeats}, "
                f"repeats={self.repeats}: expected warmup >= 0 and 1 <= min_repeats <= repeats"
            )
        if self.budget_s <= 0:
            raise ValueError(f"BenchHeadConfig.budget_s={self.budget_s}: expected > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"BenchHeadConfig.device={self.device!r}: expected auto, cpu or cuda")


@dataclass(frozen=True)
class TrimConfig:
    """Options of ``slimspec trim``: keep the ``draft_vocab_size`` most frequent target tokens."""

    draft_vocab_size: int
    data: tuple[str, ...]
    target: str
    max_length: int = DEFAULT_TRIM_MAX_LENGTH
    dtype: str | None = None
    force: bool = False

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise ValueError(f"TrimConfig.draft_vocab_size={self.draft_vocab_size}: expected >= 1")
        if not self.data:
            raise ValueError("TrimConfig.data is empty: give a calibration file (--data)")
        if self.max_length < 2:
            raise ValueError(f"TrimConfig.max_length={self.max_length}: expected >= 2")
        if self.dtype is not None:
            _check_dtype("TrimConfig", self.dtype)


@dataclass(frozen=True)
class RankSweepConfig:
    """Options of ``slimspec rank-sweep``.

    ``ranks`` entries are ints or ``"d/N"`` strings. ``kappa`` None means measure it on this machine.
    """

    ranks: tuple[int | str, ...] = tuple(f"d/{n}" for n in DEFAULT_SWEEP_RANK_DIVISORS)
    kappa: float | None = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    max_examples: int = DEFAULT_SWEEP_MAX_EXAMPLES
    max_length: int = DEFAULT_SWEEP_MAX_LENGTH
    batch_size: int = DEFAULT_SWEEP_BATCH_SIZE
    dtype: str = "float32"
    warmup: int = DEFAULT_BENCH_WARMUP
    repeats: int = DEFAULT_BENCH_REPEATS
    finetune_steps: int = 0  # 0: SVD only; N: a short head fine-tune per rank (finetune.loop.Trainer)
    finetune_data: tuple[str, ...] = ()
    force: bool = False

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("RankSweepConfig.ranks is empty")
        if self.finetune_steps < 0:
            raise ValueError(f"RankSweepConfig.finetune_steps={self.finetune_steps}: expected >= 0")
        if self.finetune_steps and not self.finetune_data:
            raise ValueError(
                "RankSweepConfig.finetune_steps needs finetune_data (--finetune-data, not the held-out data)"
            )
        if self.kappa is not None and self.kappa < 0:
            raise ValueError(f"RankSweepConfig.kappa={self.kappa}: expected >= 0")
        for name in ("num_draft_tokens", "max_examples", "batch_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"RankSweepConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.max_length < 3:
            raise ValueError(f"RankSweepConfig.max_length={self.max_length}: expected >= 3")
        if self.warmup < 0:
            raise ValueError(f"RankSweepConfig.warmup={self.warmup}: expected >= 0")
        _check_dtype("RankSweepConfig", self.dtype)


DEFAULT_E2E_MAX_NEW_TOKENS = 64
DEFAULT_E2E_MAX_PROMPTS = 8
DEFAULT_E2E_WARMUP_TOKENS = 8
E2E_PLAIN_NAME = "none"  # the plain target-decoding baseline in bench e2e


@dataclass(frozen=True)
class BenchE2EConfig:
    """Options of ``slimspec bench e2e``: drafters (name, path) timed against plain decoding, greedy.

    ``reference`` names the full-head drafter that defines kappa, nu and rho_tau (default: the first
    drafter whose head is dense and untrimmed). ``rerank`` holds (name, k) pairs: those low-rank
    drafters rescore their top-k logits with their embedding rows (``Eagle3Drafter.enable_rerank``).
    """

    drafters: tuple[tuple[str, str], ...]
    rerank: tuple[tuple[str, int], ...] = ()
    max_new_tokens: int = DEFAULT_E2E_MAX_NEW_TOKENS
    batch_size: int = 1
    draft_method: str = "tree"
    max_prompts: int = DEFAULT_E2E_MAX_PROMPTS
    dtype: str = "float32"
    reference: str | None = None
    warmup_tokens: int = DEFAULT_E2E_WARMUP_TOKENS
    force: bool = False

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ValueError("BenchE2EConfig.drafters is empty: give at least one --drafter NAME=PATH")
        names = [n for n, _ in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"BenchE2EConfig.drafters: duplicate names in {names}")
        if E2E_PLAIN_NAME in names:
            raise ValueError(
                f"BenchE2EConfig.drafters: '{E2E_PLAIN_NAME}' is the plain-decoding baseline "
                "(always run); pick another name"
            )
        if self.reference is not None and self.reference not in names:
            raise ValueError(f"BenchE2EConfig.reference={self.reference!r} is not one of {names}")
        for name, k in self.rerank:
            if name not in names:
                raise ValueError(f"BenchE2EConfig.rerank: {name!r} is not one of the drafters {names}")
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"BenchE2EConfig.rerank: {name}={k!r}, expected an integer k >= 1")
        for name in ("max_new_tokens", "batch_size", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchE2EConfig.{name}={getattr(self, name)}: expected >= 1")
        if self.warmup_tokens < 0:
            raise ValueError(f"BenchE2EConfig.warmup_tokens={self.warmup_tokens}: expected >= 0")
        DraftConfig(method=self.draft_method)  # validates the method name
        _check_dtype("BenchE2EConfig", self.dtype)


# ---- generate (issue 3) --------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerateConfig:
    """Options of ``slimspec generate`` besides drafting (:class:`DraftConfig`) and decoding
    (:class:`SamplingConfig`): prompt handling, batching and the target dtype."""

    chat: bool = True
    system_prompt: str | None = None  # None keeps the chat template's own default
    all_turns: bool = False
    batch_size: int = 1
    dtype: str = "float32"
    max_prompts: int | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"GenerateConfig.batch_size={self.batch_size}: expected >= 1")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"GenerateConfig.max_prompts={self.max_prompts}: expected >= 1")
        if self.all_turns and not self.chat:
            raise ValueError("GenerateConfig.all_turns needs chat (multi-turn prompts use the chat template)")
        _check_dtype("GenerateConfig", self.dtype)
