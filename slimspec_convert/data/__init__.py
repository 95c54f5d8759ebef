"""Conversation files (OpenAI messages, ShareGPT, GSM8K, GPTeacher, Self-Instruct, OpenAssistant) ->
token ids with an assistant-only loss mask -> batches; used by training, calibration and trimming.
"""

from slimspec_convert.data.examples import Example, build_examples, collate, load_examples, split_heldout
from slimspec_convert.data.records import (
    DataError,
    DataStats,
    has_assistant,
    jsonl_lines,
    read_conversations,
    read_text,
)
from slimspec_convert.data.self_distill import complete_prompts

__all__ = [
    "DataError",
    "DataStats",
    "Example",
    "build_examples",
    "collate",
    "complete_prompts",
    "has_assistant",
    "jsonl_lines",
    "load_examples",
    "read_conversations",
    "read_text",
    "split_heldout",
]
