"""Self-distillation: the target answers prompt-only records (batched greedy ``model.generate``, cached)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from slimspec_convert.data.records import Message, has_assistant, jsonl_lines, read_text


def complete_prompts(
    model,
    tokenizer,
    convs: list[list[Message]],
    cache_path: Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
) -> list[list[Message]]:
    """Self-distillation: let the target answer prompt-only conversations (greedy, batched).

    Answers are cached in ``cache_path`` (JSONL keyed by a hash of the rendered prompt), so a
    re-run or a resumed run regenerates nothing.

    Args:
        model: target HF causal LM.
        tokenizer: its tokenizer (chat template).
        convs: conversations; those without an assistant turn are completed.
        cache_path: JSONL cache file.
        max_new_tokens: answer length cap.
        batch_size: prompts per ``generate`` call (left padding).

    Returns:
        The conversations, each prompt-only one followed by the target's answer.
    """
    from tqdm.auto import tqdm

    cache: dict[str, str] = {}
    if cache_path.is_file():
        for _, line in jsonl_lines(read_text(cache_path)):
            rec = json.loads(line)
            cache[rec["key"]] = rec["answer"]
    todo = []
    keys = []
    for conv in convs:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        key = hashlib.sha256(text.encode()).hexdigest()[:24]
        keys.append(key)
        if not has_assistant(conv) and key not in cache:
            todo.append((key, text))
    if todo:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        try:
            with open(cache_path, "a") as f:
                for i in tqdm(range(0, len(todo), batch_size), desc="self-distill", unit="batch"):
                    chunk = todo[i : i + batch_size]
                    enc = tokenizer(
                        [t for _, t in chunk], return_tensors="pt", padding=True, add_special_tokens=False
                    ).to(model.device)
                    with torch.no_grad():
                        out = model.generate(
                            **enc,
                            max_new_tokens=max_new_tokens,
                            do_sample=False,
                            pad_token_id=tokenizer.pad_token_id,
                        )
                    for (key, _), row in zip(chunk, out[:, enc["input_ids"].shape[1] :], strict=True):
                        answer = tokenizer.decode(row, skip_special_tokens=True)
                        cache[key] = answer
                        f.write(json.dumps({"key": key, "answer": answer}) + "\n")
                    f.flush()
        finally:
            tokenizer.padding_side = side
    return [
        conv if has_assistant(conv) else conv + [{"role": "assistant", "content": cache[key]}]
        for conv, key in zip(convs, keys, strict=True)
    ]
