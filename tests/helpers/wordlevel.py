"""A word-level tokenizer with a ChatML-like chat template, so token counts can be checked by hand.

Ids: 0 ``<pad>``, 1 ``<|im_start|>``, 2 ``<|im_end|>``, 3 ``user``, 4 ``assistant``, 5 ``system``,
then the given words in order, then filler words ``w<i>`` up to ``vocab_size``. Words are split on
whitespace; the template puts spaces around every token, so the rendering of a conversation is
``<|im_start|> user a b <|im_end|> <|im_start|> assistant c c d <|im_end|> ``.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def word_tokenizer(words: list[str], vocab_size: int):
    """A fast HF tokenizer over SPECIALS + words + fillers (exactly ``vocab_size`` ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab_list = SPECIALS + list(words)
    vocab_list += [f"w{i}" for i in range(len(vocab_list), vocab_size)]
    assert len(vocab_list) == vocab_size
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(vocab_list)}, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        unk_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_target_folder(folder: Path, model, words: list[str]) -> Path:
    """Write an HF target folder: ``model`` (config + weights) and a word tokenizer of its vocab size."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    word_tokenizer(words, model.config.vocab_size).save_pretrained(folder)
    return folder
