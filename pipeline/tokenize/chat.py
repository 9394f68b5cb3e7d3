"""Chat streams: render conversations with the tokenizer's chat template, loss on assistant only.

How the loss mask is found, for any Jinja chat template: the conversation is rendered once
with every message's content replaced by a sentinel. Splitting the rendering at the sentinels
gives the template's own text ("glue": role headers, turn markers, BOS) between the contents.
Glue is tokenized with special tokens recognised; contents are tokenized as plain text, so a
user who types "<|im_end|>" cannot forge a turn boundary. Assistant contents get loss 1, and
so does the glue right after an assistant content up to and including its first special token
(`<|im_end|>`, `<|eot_id|>`, `</s>`...), so the model learns to end its turn. Everything else
(system, user, tool turns and all headers) gets loss 0 and therefore label -100.

The default tokenizer has no template of its own; tokenmill uses ChatML with the cl100k ids
of `<|im_start|>`/`<|im_end|>` (`files.DEFAULT_CHAT_TEMPLATE`). `tokenizer.chat_template` overrides
the template of any tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache

import numpy as np

from pipeline.tokenize.encoders import BACKEND_FAST, BACKEND_FASTOKENS
from pipeline.tokenize.engines import failure_reason, tokenizer_failure

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_SENTINEL = "\x1ftokenmill-content-{}\x1f"
_SENTINEL_RE = re.compile("\x1ftokenmill-content-(\\d+)\x1f")


def lone_surrogate(text: str) -> str | None:
    """None if `text` can be encoded as UTF-8, else where its first lone surrogate is.

    JSON can spell a lone surrogate ("\\ud800") and `json.loads` hands it over as is; no
    tokenizer backend can encode it the same way (HF raises, tiktoken substitutes U+FFFD), so
    such text is a bad record. ASCII text (the common case) is answered without a scan.
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}"
    return None


def validate_messages(value) -> tuple[list[dict] | None, str | None]:
    """Return (messages, None) or (None, reason) for a record's `messages` field."""
    if value is None:
        return None, "field is null"
    if not isinstance(value, list):
        return None, f"messages has type {type(value).__name__}, expected a list"
    if not value:
        return None, "empty conversation"
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return None, f"message {i} is a {type(m).__name__}, expected an object"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return None, f"message {i}: unknown role {role!r} (expected one of {sorted(ROLES)})"
        if not isinstance(content, str):
            return (
                None,
                f"message {i}: content has type {type(content).__name__}, expected a string",
            )
        bad = lone_surrogate(content)
        if bad:
            return None, f"message {i}: content has {bad}"
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in out):
        return None, "no assistant turn with content"
    return out, None


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_parts(
    messages: list[dict], template: str, bos: str = "", eos: str = ""
) -> list[tuple[str, int]]:
    """Split a rendered conversation into (text, part) pieces.

    part = -1 for template glue, else the index of the message whose content it is.
    """
    masked = [{"role": m["role"], "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    rendered = _compile(template).render(
        messages=masked, add_generation_prompt=False, bos_token=bos, eos_token=eos
    )
    parts: list[tuple[str, int]] = []
    pos, seen = 0, []
    for match in _SENTINEL_RE.finditer(rendered):
        i = int(match.group(1))
        parts.append((rendered[pos : match.start()], -1))
        parts.append((messages[i]["content"], i))
        seen.append(i)
        pos = match.end()
    parts.append((rendered[pos:], -1))
    if seen != sorted(set(seen)) or not any(messages[i]["role"] == "assistant" for i in seen):
        raise ValueError("the chat template must render each message's content once, in order")
    return parts


class ChatEncoder:
    """Tokenize conversations into (ids, loss mask), batched across a unit's conversations.

    Immutable after construction, so one encoder may serve several threads at once (the
    head start's, a pool actor's): per-call results, the backend included, are returned,
    never stored on it. Glue goes to the tokenizer's `with_specials` copy; the shared
    tokenizer itself is never touched (see `LoadedTokenizer`).
    """

    def __init__(self, tok):
        template = tok.chat_template
        if template is None:
            raise ValueError(
                f"tokenizer {tok.name!r} has no chat template; set tokenizer.chat_template"
            )
        self.tok = tok
        self.template = template
        inner = tok.tokenizer
        self._bos = inner.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
        self._eos = inner.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
        special = {inner.token_to_id(t.content) for t in inner.get_added_tokens_decoder().values()
                   if t.special}  # fmt: skip
        self._special_ids = np.array(sorted(i for i in special if i is not None), dtype=np.int64)

    def _content(self, texts: list[str]) -> tuple[list[np.ndarray], np.ndarray, dict[int, str]]:
        """Message contents, as text (the fast backend may take them, verified): ids (views of
        one array), the backend per content, and the contents the tokenizer failed on
        (`encode_records`)."""
        flat, offsets, backends, failed = self.tok.encode_records(texts)
        ids = [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        return ids, backends, failed

    def _glue(self, texts: list[str]) -> list[list[int]]:
        """Template glue, with special tokens recognised (the tokenizer's glue copy; each
        distinct text once, remembered across processes: LoadedTokenizer.encode_glue)."""
        return self.tok.encode_glue(texts)

    def encode(self, conversations: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray] | str]:
        """Per conversation: (ids int32, loss int8), or a reason string if it cannot render."""
        return self.encode_with_backend(conversations)[0]

    def encode_with_backend(
        self, conversations: list[list[dict]]
    ) -> tuple[list[tuple[np.ndarray, np.ndarray] | str], list[int]]:
        """`encode`, and per conversation the backend (encoders.BACKEND_*) that encoded
        its contents: a fast engine's code, else the code of a content HF encoded.

        A conversation the tokenizer fails on (a content of 10 MB of spaces, a Rust panic)
        gets its reason string, as a template error does; the others are kept. Glue is
        template text, but a failure there is charged to the conversations alone too: the
        batch is then encoded one conversation at a time."""
        try:
            return self._encode(conversations)
        except BaseException as e:
            if not tokenizer_failure(e):
                raise
            if len(conversations) == 1:
                return [f"the tokenizer failed on this record: {failure_reason(e)}"], [0]
        out: list[tuple[np.ndarray, np.ndarray] | str] = []
        backends: list[int] = []
        for conversation in conversations:
            [one], [backend] = self.encode_with_backend([conversation])
            out.append(one)
            backends.append(backend)
        return out, backends

    def _encode(
        self, conversations: list[list[dict]]
    ) -> tuple[list[tuple[np.ndarray, np.ndarray] | str], list[int]]:
        rendered: list[list[tuple[str, int]] | str] = []
        glue: list[str] = []
        content: list[str] = []
        for msgs in conversations:
            try:
                parts = render_parts(msgs, self.template, self._bos, self._eos)
            except Exception as e:  # a template error is this record's problem, not the run's
                rendered.append(f"chat template failed: {type(e).__name__}: {e}")
                continue
            rendered.append(parts)
            for text, part in parts:
                (glue if part < 0 else content).append(text)
        glue_ids = iter(self._glue(glue))
        encoded, content_backends, failed = self._content(content)
        content_ids = iter(encoded)
        out: list[tuple[np.ndarray, np.ndarray] | str] = []
        backends: list[int] = []
        at = 0  # the index of this conversation's first content
        for msgs, done in zip(conversations, rendered, strict=True):
            if isinstance(done, str):
                out.append(done)
                backends.append(0)
                continue
            mine = range(at, at + sum(part >= 0 for _, part in done))
            at = mine.stop
            backends.append(_backend_of(content_backends[mine.start : mine.stop]))
            bad = next((failed[i] for i in mine if i in failed), None)
            if bad is not None:
                for _, part in done:  # consume its pieces, to keep the others aligned
                    next(glue_ids if part < 0 else content_ids)
                out.append(bad)
                continue
            out.append(self._join(msgs, done, glue_ids, content_ids))
        return out, backends

    def _join(self, msgs: list[dict], parts: list[tuple[str, int]], glue_ids: Iterator[list[int]],
              content_ids: Iterator[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """One conversation's ids and loss flags from its encoded parts, an array per part
        (per-part numpy, not per-token Python: contents are most of a conversation's tokens).
        An assistant's content is learned; so is the glue after it up to the first special
        token (the turn's end), and none of it if it has no special token."""
        ids: list[np.ndarray] = []
        loss: list[np.ndarray] = []
        after_assistant = False
        for _, part in parts:
            if part < 0:
                piece = np.asarray(next(glue_ids), dtype=np.int32)
                flags = np.zeros(len(piece), dtype=np.int8)
                if after_assistant:  # learn to end the turn: up to the first special
                    hits = np.flatnonzero(np.isin(piece, self._special_ids))
                    if len(hits):
                        flags[: hits[0] + 1] = 1
                after_assistant = False
            else:
                piece = next(content_ids)
                is_assistant = msgs[part]["role"] == "assistant"
                flags = np.full(len(piece), int(is_assistant), dtype=np.int8)
                after_assistant = is_assistant
            ids.append(piece)
            loss.append(flags)
        if not ids:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int8)
        return np.concatenate(ids).astype(np.int32, copy=False), np.concatenate(loss)


def _backend_of(codes: np.ndarray) -> int:
    """One conversation's backend: its contents' one code, else the code of a content HF
    encoded instead of the fast engine (a fallback, or the split guard), else the first."""
    if len(codes) == 0:
        return 0
    slow = [int(c) for c in codes if c not in (BACKEND_FAST, BACKEND_FASTOKENS)]
    return slow[0] if slow else int(codes[0])
