"""Shared test builders: tiny seeded models built offline (d=32, V=128), a word-level tokenizer over
the committed GSM8K file, and the SmolLM2-135M drafter geometry."""

from __future__ import annotations

from pathlib import Path

import torch

from slimspec_convert.model.config import DrafterConfig
from slimspec_convert.model.drafter import Eagle3Drafter

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"


def tiny_target(seed: int = 0, vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 6):
    """A random 6-layer Llama target (d=32, V=128), float32, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model


def tiny_gemma3_target(seed: int = 0, vocab_size: int = 128, sliding_window: int = 6):
    """A random 6-layer Gemma 3 text target (d=32, 4 query heads and 1 KV head of 8, tied head,
    layers 0-4 sliding with ``sliding_window``, layer 5 full), float32, eval mode."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=sliding_window,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma's norms are (1 + w) with w = 0 at init: make them visible
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def tiny_drafter_config(**overrides) -> DrafterConfig:
    """Drafter config matching :func:`tiny_target` (d=32, V=128, 3 aux states of width 32)."""
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        draft_vocab_size=128,
        aux_layer_ids=(2, 3, 4),
    )
    base.update(overrides)
    return DrafterConfig(**base)


def tiny_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    """A random tiny drafter; with a trimmed vocab, ``d2t`` keeps every other target id."""
    torch.manual_seed(seed)
    cfg = tiny_drafter_config(**overrides)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:  # norms: random around 1 so a wrong norm is visible
                p.copy_(1 + 0.1 * torch.randn_like(p))
        if cfg.is_trimmed:
            kept = torch.arange(cfg.draft_vocab_size) * (cfg.vocab_size // cfg.draft_vocab_size)
            drafter.d2t.copy_(kept - torch.arange(cfg.draft_vocab_size))
            drafter.t2d.zero_()
            drafter.t2d[kept] = True
    return drafter.eval()


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tiny_tokenizer(vocab_size: int = 128):
    """A word-level fast tokenizer over the most frequent words of the GSM8K training file.

    Ids: 0 <pad>, 1 <s>, 2 <|im_end|> (eos), 3 <|im_start|>, 4 <unk>, then words by frequency;
    roles ``user``/``assistant``/``system`` are always in the vocabulary. ChatML-like template.
    """
    import collections
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>", "user", "assistant", "system"]
    counter: collections.Counter[str] = collections.Counter()
    pre = pre_tokenizers.Whitespace()
    with open(DATA / "train" / "gsm8k" / "train.jsonl") as f:
        for line in list(f)[:500]:
            rec = json.loads(line)
            for text in (rec["question"], rec["answer"]):
                counter.update(w for w, _ in pre.pre_tokenize_str(text))
    words = [w for w, _ in counter.most_common() if w not in specials][: vocab_size - len(specials)]
    vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials[:5])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_char_tokenizer(vocab_size: int = 16):
    """A character-level fast tokenizer: 0 <pad>, 1 <s>, 2 </s> (eos), then the letters a, b, c, ...

    Each id decodes to exactly one character (no spaces), which transformers' ``StopStringCriteria``
    needs (it cannot read a word-level vocabulary).
    """
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + list(string.ascii_lowercase[: vocab_size - 3]))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def smollm2_drafter_config(**overrides) -> DrafterConfig:
    """The geometry of an EAGLE-3 drafter for SmolLM2-135M (d=576, 9/3 heads of 64, I=1536, V=49152)."""
    base = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        draft_vocab_size=49152,
    )
    base.update(overrides)
    return DrafterConfig(**base)


def read_tensors(folder: Path) -> dict:
    """Every tensor of ``folder/model.safetensors``, read with the reference safetensors library."""
    from safetensors import safe_open

    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
