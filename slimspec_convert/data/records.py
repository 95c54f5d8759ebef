"""Training data: files -> conversations -> token ids with an assistant-only loss mask -> batches.

Accepted record formats (``.jsonl`` one record per line, or ``.json`` holding an array):

* OpenAI ``{"messages": [{"role", "content"}, ...]}``
* ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``
* GSM8K ``{"question", "answer"}``; GPTeacher ``{"instruction", "input", "response"}``;
  Self-Instruct ``{"instruction", "instances": [{"input", "output"}]}`` (one conversation per instance)
* OpenAssistant trees ``{"prompt": {"role": "prompter", "text", "replies": [...]}}`` (every
  root-to-leaf path is a conversation)
* any of these gzip-compressed (a name ending in ``.gz``: ``FILE.jsonl.gz``, ``FILE.json.gz``)
* completions ``{"prefix": str, "completion": str}`` (a base model's continuation of raw text: the
  messages ``[{"role": "prefix"}, {"role": "completion"}]``, always encoded as raw text after
  ``<bos>``, the completion supervised); ``{"prefix": str}`` alone is a completion prompt
* prompts only: a bare JSON string, ``{"prompt": str}`` or MT-Bench ``{"turns": [...]}``; these have
  no assistant turn and are either completed by the target (self-distillation) or skipped and counted.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

Message = dict[str, str]


ROLE_MAP = {
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


PREFIX_ROLE = "prefix"  # raw text a base model continues (completion records)


COMPLETION_ROLE = "completion"  # the continuation: supervised like an assistant turn


class DataError(ValueError):
    """Unusable training data; the message names the file and line."""


@dataclass
class DataStats:
    """Counts of what was read, kept and skipped (reported at the end of data loading)."""

    records: int = 0
    conversations: int = 0
    kept: int = 0
    skipped_no_assistant: int = 0
    skipped_empty: int = 0
    truncated: int = 0
    supervised_tokens: int = 0
    files: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line of counts."""
        return (
            f"{self.records} records -> {self.conversations} conversations, kept {self.kept}, "
            f"skipped {self.skipped_no_assistant} without an assistant turn and {self.skipped_empty} empty, "
            f"truncated {self.truncated}; {self.supervised_tokens} supervised tokens"
        )


def decode_text(data: bytes, path: str | Path) -> str:
    """A data file's bytes as UTF-8 text: the one place data, prompt and cache files are decoded.

    Args:
        data: the file's bytes (after gzip, for a ``.gz`` file).
        path: the file, for the message.

    Returns:
        The text.

    Raises:
        DataError: ``{path}:{line}: not UTF-8 (byte 0x.. at column ..)``, naming the fix.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}); save the file "
            "as UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT`"
        ) from None


def read_text(path: str | Path) -> str:
    """:func:`decode_text` of a file's bytes.

    Raises:
        DataError: not UTF-8 (file, line and column in the message).
        OSError: the file cannot be read.
    """
    return decode_text(Path(path).read_bytes(), path)


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a JSON Lines text, split at ``"\\n"`` only: the one place a ``.jsonl``
    file's text is split into its records.

    JSON Lines (https://jsonlines.org) ends each record with ``"\\n"`` (``"\\r\\n"`` allowed).
    ``str.splitlines()`` also breaks at U+2028, U+2029, U+0085, ``\\v``, ``\\f`` and
    ``\\x1c``-``\\x1e``, which JSON allows raw inside strings (``json.dumps(..., ensure_ascii=False)``,
    pandas ``to_json(force_ascii=False)``, many published chat datasets): split with it, a valid
    record reads as two broken ones ("unterminated string").

    Args:
        text: the whole file, decoded.

    Returns:
        An iterator of (1-based line number, line without its ``"\\r\\n"`` / ``"\\n"`` ending); the
        numbers are the file's own, blank lines skipped, for error messages that name the line.
    """
    for lineno, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            yield lineno, line


def _read_records(path: Path) -> Iterator[tuple[int, object]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: data file not found")
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(path.read_bytes())
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: not a readable gzip file ({e})") from e
        text = decode_text(raw, path)
        kind = Path(path.stem).suffix
    else:
        text = read_text(path)
        kind = path.suffix
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    if kind == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from e
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold an array of records")
        yield from ((i + 1, rec) for i, rec in enumerate(data))
        return
    for lineno, line in jsonl_lines(text):
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from e


def _oasst_paths(node: dict, prefix: list[Message]) -> Iterator[list[Message]]:
    msg = {"role": ROLE_MAP.get(node.get("role", ""), "user"), "content": node.get("text", "")}
    convo = prefix + [msg]
    replies = [r for r in node.get("replies", []) if not r.get("deleted")]
    if not replies:
        yield convo
    for r in replies:
        yield from _oasst_paths(r, convo)


def record_to_conversations(rec: object, where: str) -> list[list[Message]]:
    """Normalise one record of any accepted format into OpenAI-style message lists.

    Raises:
        DataError: unknown record shape (message names ``where`` = file:line).
    """
    if isinstance(rec, str):
        return [[{"role": "user", "content": rec}]]
    if not isinstance(rec, dict):
        raise DataError(f"{where}: record is a {type(rec).__name__}, expected an object or a string")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in msgs
        ):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return [[{"role": ROLE_MAP.get(m["role"], m["role"]), "content": str(m["content"])} for m in msgs]]
    if "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list) or not all(
            isinstance(m, dict) and "from" in m and "value" in m for m in conv
        ):
            raise DataError(f"{where}: 'conversations' must be a list of {{from, value}} objects")
        return [[{"role": ROLE_MAP.get(m["from"], "user"), "content": str(m["value"])} for m in conv]]
    if "prefix" in rec and isinstance(rec["prefix"], str):
        conv = [{"role": PREFIX_ROLE, "content": rec["prefix"]}]
        if "completion" in rec:
            if not isinstance(rec["completion"], str):
                raise DataError(f"{where}: 'completion' must be a string")
            conv.append({"role": COMPLETION_ROLE, "content": rec["completion"]})
        return [conv]
    if "question" in rec and "answer" in rec:
        return [
            [{"role": "user", "content": rec["question"]}, {"role": "assistant", "content": rec["answer"]}]
        ]
    if "instruction" in rec and "response" in rec:
        user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        return [[{"role": "user", "content": user}, {"role": "assistant", "content": rec["response"]}]]
    if "instruction" in rec and "instances" in rec:
        out = []
        for inst in rec["instances"]:
            user = rec["instruction"] + (f"\n\n{inst['input']}" if inst.get("input") else "")
            out.append(
                [{"role": "user", "content": user}, {"role": "assistant", "content": inst.get("output", "")}]
            )
        return out
    if "prompt" in rec and isinstance(rec["prompt"], dict):
        return list(_oasst_paths(rec["prompt"], []))
    if "prompt" in rec and isinstance(rec["prompt"], str):
        return [[{"role": "user", "content": rec["prompt"]}]]
    if "turns" in rec and isinstance(rec["turns"], list) and rec["turns"]:
        return [[{"role": "user", "content": str(rec["turns"][0])}]]
    raise DataError(f"{where}: unknown record format with keys {sorted(rec)[:8]}")


def read_conversations(paths: list[str | Path], stats: DataStats | None = None) -> list[list[Message]]:
    """All conversations of the given files, in file order.

    Raises:
        FileNotFoundError: a missing file.
        DataError: empty file, malformed line, unknown record shape (names file:line).
    """
    stats = stats if stats is not None else DataStats()
    out: list[list[Message]] = []
    for p in paths:
        path = Path(p)
        stats.files.append(str(path))
        for lineno, rec in _read_records(path):
            stats.records += 1
            convs = record_to_conversations(rec, f"{path}:{lineno}")
            stats.conversations += len(convs)
            out.extend(convs)
    return out


def has_assistant(conv: list[Message]) -> bool:
    """True when some message has role ``assistant`` (or ``completion``: a completion record's)."""
    return any(m["role"] in ("assistant", COMPLETION_ROLE) for m in conv)


def is_completion(conv: list[Message]) -> bool:
    """True for a completion record (``{"prefix", "completion"}``): raw text, no chat template."""
    return bool(conv) and conv[0]["role"] == PREFIX_ROLE
