"""The drafter as nn.Modules: its config, the EAGLE-3 drafter, the low-rank head, its KV cache, the
training-time-test unroll and the draft-vocabulary maps.
"""

from slimspec_convert.model.config import DrafterConfig, default_aux_boundaries
from slimspec_convert.model.drafter import Eagle3Drafter, with_head
from slimspec_convert.model.head import LowRankHead, head_rank, make_head
from slimspec_convert.model.kv_cache import DraftKVCache
from slimspec_convert.model.ttt import ttt_unroll
from slimspec_convert.model.vocab import VocabMapError, draft_to_target_ids, validate_vocab_maps

__all__ = [
    "DraftKVCache",
    "DrafterConfig",
    "Eagle3Drafter",
    "LowRankHead",
    "VocabMapError",
    "default_aux_boundaries",
    "draft_to_target_ids",
    "head_rank",
    "make_head",
    "ttt_unroll",
    "validate_vocab_maps",
    "with_head",
]
