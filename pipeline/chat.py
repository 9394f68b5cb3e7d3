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
of `<|im_start|>`/`<|im_end|>` (DEFAULT_CHAT_TEMPLATE). `tokenizer.chat_template` overrides
the template of any tokenizer.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
)
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
    """Tokenize conversations into (ids, loss mask), batched across a unit's conversations."""

    def __init__(self, tok):
        template = tok.chat_template
        if template is None:
            raise ValueError(
                f"tokenizer {tok.name!r} has no chat template; set tokenizer.chat_template"
            )
        self.tok = tok
        self.template = template
        self.last_backend = 0  # tokenization.BACKEND_* of the last content batch
        inner = tok.tokenizer
        self._bos = inner.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
        self._eos = inner.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
        self._special_ids = {
            inner.token_to_id(t.content)
            for t in inner.get_added_tokens_decoder().values()
            if t.special
        }

    def _encode(self, texts: list[str], specials: bool) -> list[list[int]]:
        if not specials:  # message content: the fast backend may take it, verified
            flat, offsets, self.last_backend = self.tok.encode_verified(texts)
            return [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        inner = self.tok.tokenizer
        inner.encode_special_tokens = not specials
        try:
            fast = getattr(inner, "encode_batch_fast", inner.encode_batch)
            return [e.ids for e in fast(texts, add_special_tokens=False)]
        finally:
            inner.encode_special_tokens = True

    def encode(self, conversations: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray] | str]:
        """Per conversation: (ids int32, loss int8), or a reason string if it cannot render."""
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
        glue_ids = iter(self._encode(glue, specials=True))
        content_ids = iter(self._encode(content, specials=False))
        out: list[tuple[np.ndarray, np.ndarray] | str] = []
        for msgs, done in zip(conversations, rendered, strict=True):
            if isinstance(done, str):
                out.append(done)
                continue
            ids: list[int] = []
            loss: list[int] = []
            after_assistant = False
            for _, part in done:
                if part < 0:
                    piece = next(glue_ids)
                    flags = [0] * len(piece)
                    if after_assistant:  # learn to end the turn: up to the first special
                        for j, t in enumerate(piece):
                            flags[j] = 1
                            if t in self._special_ids:
                                break
                        else:
                            flags = [0] * len(piece)
                    after_assistant = False
                else:
                    piece = next(content_ids)
                    is_assistant = msgs[part]["role"] == "assistant"
                    flags = [int(is_assistant)] * len(piece)
                    after_assistant = is_assistant
                ids += piece
                loss += flags
            out.append((np.asarray(ids, dtype=np.int32), np.asarray(loss, dtype=np.int8)))
        return out
