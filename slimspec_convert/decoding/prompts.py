"""Prompt files (JSONL) and chat templating for ``slimspec generate``.

A JSONL line is either ``{"prompt": "..."}`` or MT-Bench style ``{"turns": ["...", ...]}``
(lm-sys/FastChat ``llm_judge/data/mt_bench/question.jsonl``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from slimspec_convert.data import jsonl_lines, read_text
from slimspec_convert.targets.load import bos_text


def load_prompts(path: str | Path, all_turns: bool = False) -> list[tuple[str, ...]]:
    """Read user turns from a JSONL file.

    Args:
        path: JSONL file, one object per line with ``prompt`` (str) or ``turns`` (list of str).
        all_turns: keep every turn of ``turns`` (a conversation); otherwise only the first.

    Returns:
        One tuple of user turns per line (length 1 unless ``all_turns``).

    Raises:
        FileNotFoundError: path missing.
        ValueError: invalid JSON, or a line without a usable ``prompt`` / ``turns``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: prompt file not found")
    out: list[tuple[str, ...]] = []
    for n, line in jsonl_lines(read_text(p)):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: invalid JSON ({e})") from e
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            turns: tuple[str, ...] = (obj["prompt"],)
        elif (
            isinstance(obj, dict)
            and isinstance(obj.get("turns"), list)
            and obj["turns"]
            and all(isinstance(t, str) for t in obj["turns"])
        ):
            turns = tuple(obj["turns"]) if all_turns else (obj["turns"][0],)
        else:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(
                f"{p}:{n}: expected a 'prompt' string or a non-empty 'turns' list of strings, got {keys}"
            )
        out.append(turns)
    if not out:
        raise ValueError(f"{p}: no prompts (empty file)")
    return out


def prompt_kinds(path: str | Path) -> list[str | None]:
    """The ``kind`` field of each line of a prompt file (writing, code, ...; None where a line has
    none), in the order :func:`load_prompts` returns the prompts.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_prompts`.
    """
    load_prompts(path)  # the same checks, the same errors
    out = []
    for _, line in jsonl_lines(read_text(Path(path))):
        kind = json.loads(line).get("kind")
        out.append(kind if isinstance(kind, str) else None)
    return out


def chat_template_id(tokenizer) -> str | None:
    """Short id of the tokenizer's chat template: ``sha256:<first 12 hex>``, None without one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return "sha256:" + hashlib.sha256(template.encode("utf-8")).hexdigest()[:12]


def render_chat(
    tokenizer,
    user_turns: Sequence[str],
    assistant_turns: Sequence[str] = (),
    system_prompt: str | None = None,
) -> str:
    """The text the target sees for a conversation, ending with the assistant's generation prompt.

    Args:
        tokenizer: HF tokenizer with a chat template.
        user_turns: user messages, oldest first.
        assistant_turns: the assistant's earlier answers (one fewer than user_turns).
        system_prompt: a system message; None keeps the template's own default (if any).

    Returns:
        The rendered prompt string (special tokens included as text).

    Raises:
        ValueError: the tokenizer has no chat template, or the turn counts do not fit.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target tokenizer has no chat template; run with --no-chat")
    if len(assistant_turns) != len(user_turns) - 1:
        raise ValueError(
            f"{len(user_turns)} user turns need {len(user_turns) - 1} answers, got {len(assistant_turns)}"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    for i, user in enumerate(user_turns):
        messages.append({"role": "user", "content": user})
        if i < len(assistant_turns):
            messages.append({"role": "assistant", "content": assistant_turns[i]})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_prompt(tokenizer, prompt: str, chat: bool, system_prompt: str | None = None) -> str:
    """The full text the target sees for one user prompt, special tokens included as text.

    Tokenise the result with ``add_special_tokens=False``.

    Args:
        tokenizer: the target's tokenizer.
        prompt: the user's prompt (chat) or the text to continue (completion).
        chat: True renders with the chat template (:func:`render_chat`); False is a completion
            prompt, the raw text after the ``<bos>`` the tokenizer adds on its own (if any).
        system_prompt: chat only.

    Returns:
        The text.

    Raises:
        ValueError: chat with a tokenizer that has no chat template.
    """
    if chat:
        return render_chat(tokenizer, [prompt], (), system_prompt)
    return bos_text(tokenizer) + prompt
