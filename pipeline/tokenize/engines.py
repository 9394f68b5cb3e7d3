"""Tokenizers: loading once per worker process, and batched encoding into flat numpy arrays.

Where the tokenizer.json comes from (the offline cl100k default, a file, the Hub cache) is
`pipeline.tokenize.files`; the proofs behind the fast backend are `pipeline.tokenize.proofs`.

The HF tokenizer is the reference: its ids are the ids. An optional *fast backend* encodes
instead where it is exact. It is rank-order BPE over the tokenizer's own ranks behind its own
split regex, run by one of two engines: `fastokens` (Rust BPE, PCRE2's JIT for the split: ~5x
tiktoken on one core here, ~18x HF) where its wheel is installed, else tiktoken (~3.5x HF).
Exactness is proven where it can be: at load, `prove_fast` checks over the whole vocabulary and
merge list that rank-order BPE over these ranks and the HF BPE model give the same ids on every
pre-token (the verdict is cached on disk by the tokenizer.json's sha256); both engines
implement rank-order BPE. The split into pre-tokens runs the same regex on different engines
(Oniguruma; fancy-regex or PCRE2). Its character classes are proven at load over every code
point (`proofs.split_exceptions`): a text holding a code point where the engines' classes
differ (U+180E for cl100k on PCRE2) is encoded by HF (`SplitGuard`, `hf_split`). Its
structure is sampled: a fixed probe set at load, then a byte-proportional sample of every
encode call is also encoded by the HF tokenizer and compared; any mismatch sends that whole
call to the HF tokenizer (or is an error under ``tokenizer.backend: tiktoken`` or
``fastokens``). Every decision is a function of the call's texts only, so output stays
deterministic whichever process encodes it.

Threads: a `LoadedTokenizer` is immutable once loaded and shared by every thread of a process
(see its docstring); `_CACHE` is filled under `_LOADING`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from pipeline.config import TokenizerConfig, tokenizer_digest
from pipeline.tokenize.files import (
    CL100K_HF_PATTERN,
    CL100K_SHA256,
    CL100K_SPECIALS,
    DEFAULT_CHAT_TEMPLATE,
    TokenizerFile,
    cache_dir,
    cl100k_ranks_file,
    default_tokenizer_file,
    open_tokenizer,
)
from pipeline.tokenize.proofs import (
    FastGuarantees,
    byte_level_vocab,
    prove_cached,
    prove_fast,
    split_exceptions,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

NormalForm = Literal["NFC", "NFD", "NFKC", "NFKD"]  # unicodedata.normalize's forms

# tiktoken's own cl100k split pattern (fancy-regex syntax: possessive quantifiers, `$` = end).
CL100K_TIKTOKEN_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

# Texts that exercise the places where a BPE port usually goes wrong: digit runs (the
# Oniguruma `{1,3}+` trap), whitespace runs before newlines and at the end, contractions in
# both cases, non-Latin scripts, combining marks, emoji, control bytes, special-token text.
FAST_PROBE = (
    "0010 12 123 1234 12345 1234567 3.14159 0x7fff 1e-10 2026-11-22",
    "x  \n\n  y   \n\t\t\n   ",
    "a \r\n\r\n b\r\r\n",
    "   ",
    "I'M don'T you'LL we'Ve she'd it's O'Reilly ''quoted''",
    "héllo wörld naïve café Straße ǅ ﬁ Ⅻ ½ ²",
    "你好，世界。日本語のテキスト 한국어 텍스트 العربية עברית русский ελληνικά",
    "emoji 🎉🎉 👩‍👩‍👧 ✈️ \u200b\u00a0 zero-width",
    "\x00\x01\x7f control \x1b[0m",
    "<|endoftext|> <|im_start|>user <|im_end|> <|fim_prefix|>",
    "    def f(self, x):\n        return {'a': [1, 2, 3]}  # comment\n\n\n",
    '!!!??? ... --- === +++ *** /// \\\\ """ ``` ~~~',
    # U+180E, a space to PCRE2 and not to Oniguruma (`split_exceptions` sends it to HF), and
    # the whitespace family after and before spaces, letters, digits and newlines.
    "  \u180e a\u180eb 1\u180e\u180e2 \u180e\n\u180e  \u180e\t",
    "a\u0085b \u00a0 \u1680x\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
    "\u200a y \u2028\u2029 \u202f\u205f\u3000 \x0b\x0c\x1c\x1d\x1e\x1f \u200b\ufeff\n  ",
)


# Which backend encoded a batch: blocks carry it per row, the feed reports tokens per name.
# `pretokenized`: ids read as they are from an export (format: export), no tokenizer ran.
# `hf_split`: texts holding a code point on which the fast split is not proven (SplitGuard).
BACKEND_HF, BACKEND_FAST, BACKEND_HF_FALLBACK, BACKEND_NONE, BACKEND_FASTOKENS = 0, 1, 2, 3, 4
BACKEND_HF_SPLIT = 5
BACKEND_NAMES = ("hf", "tiktoken", "hf_fallback", "pretokenized", "fastokens", "hf_split")


class SplitGuard:
    """The code points on which a fast engine's split is not proven to be HF's
    (`proofs.split_exceptions`): an encode call with a text holding one goes to HF.

    Immutable once built (at load), so shared by every thread. The check costs nothing on
    ASCII text (`str.isascii`, where no such code point is ASCII) and one `in` per code point
    on the rest (a C search); for a normalizing tokenizer, on the normalized text, which is
    what the engines split.
    """

    __slots__ = ("code_points", "normalize", "_chars", "_ascii_safe")

    def __init__(self, code_points: tuple[int, ...], normalize: NormalForm | None = None):
        self.code_points = code_points
        self.normalize = normalize
        self._chars = tuple(chr(c) for c in code_points)
        self._ascii_safe = all(c >= 0x80 for c in code_points)

    def describe(self) -> str:
        shown = ", ".join(f"U+{c:04X}" for c in self.code_points[:8])
        more = f" and {len(self.code_points) - 8} more" if len(self.code_points) > 8 else ""
        return f"proven; to hf: {shown}{more}"

    def hits(self, texts: list[str]) -> bool:
        """Whether any text holds one of the code points."""
        for text in texts:
            if self._ascii_safe and text.isascii():
                continue
            if self.normalize is not None:
                import unicodedata

                text = unicodedata.normalize(self.normalize, text)
            if any(ch in text for ch in self._chars):
                return True
        return False


class FastEncoder:
    """tiktoken's BPE over the same ranks, used only where it reproduces the HF tokenizer.

    `normalize`: a Unicode normal form the HF tokenizer applies first (e.g. Qwen2's NFC).
    """

    name = "tiktoken"
    code = BACKEND_FAST

    def __init__(self, encoding, normalize: NormalForm | None = None):
        self.encoding = encoding
        self.normalize = normalize

    @property
    def ranks(self) -> dict[bytes, int]:
        """The byte string -> rank table the encoding merges by (what `prove_fast` checks)."""
        return self.encoding._mergeable_ranks

    def encode(self, texts: list[str]) -> list[list[int]]:
        # encode_ordinary: special-token text is text, as with encode_special_tokens=True.
        enc = self.encoding.encode_ordinary
        if self.normalize is not None:
            import unicodedata

            form = self.normalize
            return [enc(unicodedata.normalize(form, t)) for t in texts]
        return [enc(t) for t in texts]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat int32 ids, int64 offsets), as `LoadedTokenizer.encode` returns them."""
        return _flatten(self.encode(texts))


class FastokensEncoder(FastEncoder):
    """fastokens' rank-order BPE (Rust; the split on PCRE2's JIT) over the same ranks and
    pattern as the tiktoken encoder, so the same proofs hold for it and the same probe and
    samples check its split.

    Why: tokenizing was ~80% of a worker's CPU with tiktoken. On the man pages one core
    (pinned with taskset) encodes 16.0M tokens/s with it against 3.1M with tiktoken, straight
    into flat buffers (no per-token Python ints), with the same ids on all 36.4M tokens. It
    is loaded beside the HF tokenizer (its load releases the GIL) and costs ~0.4 s and ~60 MB
    per process.
    `ranks`: a callable for the rank table, read only when a proof is not cached.
    """

    name = "fastokens"
    code = BACKEND_FASTOKENS

    def __init__(self, tokenizer, ranks, normalize: NormalForm | None = None):
        self.encoding = tokenizer
        self._ranks = functools.cache(ranks)
        self.normalize = normalize

    @property
    def ranks(self) -> dict[bytes, int]:
        return self._ranks()

    def encode(self, texts: list[str]) -> list[list[int]]:
        flat, offsets = self.encode_flat(texts)
        return [flat[a:b].tolist() for a, b in itertools.pairwise(offsets.tolist())]

    def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self.normalize is not None:
            import unicodedata

            texts = [unicodedata.normalize(self.normalize, t) for t in texts]
        # Special-token text is text (as encode_ordinary); there are no added tokens anyway.
        ids, offsets = self.encoding.encode_batch_flat(texts, split_special_tokens=True)
        # Little-endian uint32 ids (all < 2**31) and uint64 offsets, read in place.
        return np.frombuffer(ids, dtype="<i4"), np.frombuffer(offsets, dtype="<i8")


# GPT-2's split, which HF's ByteLevel pre-tokenizer applies itself when `use_regex` is on.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass(frozen=True)
class BpeForm:
    """A byte-level BPE tokenizer as the fast engines take it: rank-order BPE over `ranks()`
    behind one split `pattern`, after an optional Unicode `normalize`. `ranks_file()` is the
    same table as a tiktoken ranks file (fastokens reads one)."""

    pattern: str
    ranks: Callable[[], dict[bytes, int]]
    ranks_file: Callable[[], Path]
    normalize: NormalForm | None = None
    hf_pattern: str | None = None  # the HF tokenizer's own spelling, where it differs


def _bpe_form(doc: dict | None, default: bool) -> BpeForm | None:
    """The fast form of a byte-level BPE tokenizer, or None if it has no such form.

    The default tokenizer uses the cl100k ranks file itself. Any other tokenizer (`doc`, its
    parsed tokenizer.json) qualifies when it is byte-level BPE behind one Split regex (Llama 3,
    Qwen2) or behind ByteLevel's own GPT-2 split, with no byte fallback and no normalizer
    other than NFC/NFKC; its vocab ids become the ranks (true of tiktoken-born vocabularies
    and of GPT-2's).
    Exactness is not assumed: `prove_fast` proves the BPE part, and the probe and the
    per-batch samples check the regex split.
    """
    if default:
        from tiktoken.load import load_tiktoken_bpe

        def ranks_file() -> Path:
            path = cl100k_ranks_file()
            if hashlib.sha256(path.read_bytes()).hexdigest() != CL100K_SHA256:
                raise ValueError(f"{path}: not the pinned cl100k ranks (sha256 differs)")
            return path

        return BpeForm(
            CL100K_TIKTOKEN_PATTERN,
            functools.cache(
                lambda: load_tiktoken_bpe(str(cl100k_ranks_file()), expected_hash=CL100K_SHA256)
            ),
            ranks_file,
            hf_pattern=CL100K_HF_PATTERN,
        )
    assert doc is not None  # only the default tokenizer comes without a tokenizer.json
    model, pre = doc.get("model") or {}, doc.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return None
    normalizer = doc.get("normalizer")
    normalize: NormalForm | None = None
    if normalizer is not None:
        if normalizer.get("type") not in ("NFC", "NFKC"):
            return None
        normalize = normalizer["type"]
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    pattern = None
    for step in steps:
        if step.get("type") == "Split" and "Regex" in (step.get("pattern") or {}):
            if step.get("behavior") != "Isolated" or step.get("invert") or pattern:
                return None
            pattern = step["pattern"]["Regex"]
        elif step.get("type") == "ByteLevel":
            if step.get("add_prefix_space"):
                return None
            if step.get("use_regex", True):  # GPT-2 style: the split is ByteLevel's own
                if pattern:
                    return None
                pattern = GPT2_PATTERN
        else:
            return None
    if pattern is None:
        return None
    ranks = byte_level_vocab(model.get("vocab", {}))
    if any(bytes([b]) not in ranks for b in range(256)):
        return None
    return BpeForm(pattern, lambda: ranks, functools.cache(lambda: _ranks_file(ranks)), normalize)


def _ranks_file(ranks: dict[bytes, int]) -> Path:
    """`ranks` as a tiktoken ranks file (base64 token, space, rank; one per line), written
    once into the cache under the digest of its content."""
    import base64

    body = "".join(
        f"{base64.b64encode(t).decode()} {r}\n"
        for t, r in sorted(ranks.items(), key=lambda x: x[1])
    ).encode()
    path = cache_dir() / "ranks" / f"{hashlib.sha256(body).hexdigest()[:24]}.tiktoken"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        os.replace(tmp, path)  # atomic: workers may race to write the same file
    return path


def _tiktoken_engine(form: BpeForm) -> FastEncoder | None:
    """tiktoken over `form`, or None (not installed; a pattern fancy-regex cannot compile)."""
    try:
        import tiktoken
    except ImportError:
        return None
    try:
        ranks = form.ranks()
        enc = tiktoken.Encoding(
            "fast", pat_str=form.pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except Exception:
        return None
    return FastEncoder(enc, form.normalize)


def _fastokens_engine(
    form: BpeForm, entering: threading.Event | None = None
) -> FastokensEncoder | None:
    """fastokens over `form`, or None (no wheel for this platform; a pattern PCRE2 refuses).
    `entering` is set just before the native load (see `_preload_fastokens`), and on return."""
    try:
        import fastokens

        path = str(form.ranks_file())
        if entering is not None:
            entering.set()
        tok = fastokens.Tokenizer.from_tiktoken(path, pattern=form.pattern, special_tokens={})
    except Exception:  # ImportError included
        return None
    finally:
        if entering is not None:
            entering.set()
    return FastokensEncoder(tok, form.ranks, form.normalize)


# The engines each `tokenizer.backend` may use, fastest first.
ENGINES = {
    "auto": (_fastokens_engine, _tiktoken_engine),
    "fastokens": (_fastokens_engine,),
    "tiktoken": (_tiktoken_engine,),
}


def _hf_ids(tok, texts: list[str]) -> list[list[int]]:
    fast = getattr(tok, "encode_batch_fast", None)  # skips offset tracking where available
    return [e.ids for e in (fast or tok.encode_batch)(texts, add_special_tokens=False)]


def _flatten(ids: list) -> tuple[np.ndarray, np.ndarray]:
    """Per-text ids (lists or arrays) as (flat int32 ids, int64 offsets)."""
    lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    for i, x in enumerate(ids):
        flat[offsets[i] : offsets[i + 1]] = x
    return flat, offsets


# The least a batch's check covers, in characters, however small the batch: a text this short
# costs HF ~0.1 ms here.
VERIFY_MIN_CHARS = 256


def verify_sample(texts: list[str], fraction: float) -> list[tuple[int, int, int]]:
    """What to check against HF: (text index, start, end) character windows, about
    `fraction` of the characters (at least VERIFY_MIN_CHARS).

    Every k-th text (k = 1/fraction) from the first is taken whole while the character budget
    (`fraction` of the batch) lasts. If none fits, one window of the budget's length from the
    middle of the shortest text (the whole text if it is that short). So the check costs about
    `fraction` of an HF encode whatever the document sizes, spreads over the batch, and is a
    pure function of it (the same batch is always checked the same way).

    The window is the fix for long documents. Checking the shortest text whole made a batch
    of a few 300k-character documents ~30% HF's, and a one-document batch 100%: the verified
    path ran at 1.96M and 0.57M tokens/s against fastokens' ~20M alone (docs of 300k and
    1.2M characters, this VM). A window is a string both engines encode, so it checks them as
    a whole text would.
    """
    if not texts:
        return []
    budget = fraction * sum(len(t) for t in texts)
    picked, used = [], 0
    for i in range(0, len(texts), max(1, round(1 / fraction))):
        if used + len(texts[i]) <= budget:
            picked.append((i, 0, len(texts[i])))
            used += len(texts[i])
    if picked:
        return picked
    i = min(range(len(texts)), key=lambda i: len(texts[i]))
    n = min(len(texts[i]), max(VERIFY_MIN_CHARS, int(budget)))
    start = (len(texts[i]) - n) // 2
    return [(i, start, start + n)]


class FastBackendError(ValueError):
    """`tokenizer.backend: tiktoken` (or `fastokens`) was asked for, and it is not exact here."""


# Guards the one-time build of every LoadedTokenizer's glue tokenizer (`with_specials`).
_GLUE_LOCK = threading.Lock()
_GLUE_IDS_LOCK = threading.Lock()
GLUE_KEEP = 4096  # glue texts kept per tokenizer (LoadedTokenizer.encode_glue)


@dataclass(frozen=True)
class LoadedTokenizer:
    """A `tokenizers.Tokenizer` plus the special ids the pipeline needs.

    `guarantees`: what was proven about the fast backend at load (`FastGuarantees`), or None
    where none was considered (backend hf, or no byte-level BPE form).

    Shared by every thread of a process (the feed, the head start's threads, one per stream,
    a pool actor's calls): it is immutable once `load_tokenizer` returns it. `tokenizer`
    encodes special-token text as text (`encode_special_tokens` set at load and never again);
    chat template glue, which needs special tokens recognised, goes to a second HF tokenizer
    (`with_specials`), built once under `_GLUE_LOCK` and never mutated either. Toggling the
    flag on the one shared tokenizer "just for this call" raised "Already borrowed" in the
    other thread's encode, or let it encode user text with special tokens recognised.
    The fast engines (tiktoken, fastokens) encode through `&self`: concurrent calls are safe.
    """

    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    name: str
    fast: FastEncoder | None = None
    backend: str = "hf"
    verify_fraction: float = 0.01
    guarantees: FastGuarantees | None = None
    split_guard: SplitGuard | None = None
    # The tokenizer.json `tokenizer` was read from unchanged (but for the flag), with its
    # (size, mtime_ns) then: the glue copy is read from it again (`with_specials`).
    source: tuple[Path, tuple[int, int]] | None = None
    # Ids in the vocabulary, added tokens included: asked once at load (`Tokenizer.
    # get_vocab_size` builds the whole vocabulary on each call, ~40 ms for 100k ids: too slow
    # to ask per unit read).
    vocab_size: int = 0
    # Glue ids by text (`encode_glue`), this process's: filled from the glue file and by
    # encoding what it lacks; written under _GLUE_IDS_LOCK only.
    _glue_ids: dict = field(default_factory=dict, repr=False, compare=False)
    _glue_key: list = field(default_factory=list, repr=False, compare=False)
    # The glue tokenizer, once built (see the class docstring); written under _GLUE_LOCK only.
    _glue: list = field(default_factory=list, repr=False, compare=False)

    def with_specials(self) -> Tokenizer:
        """A copy of `tokenizer` that recognises special-token text (for chat template glue).

        Built on first use (only chat streams need it: ~0.5 s and ~50 MB for cl100k), under a
        lock so that threads asking at once build it once; never mutated after."""
        if not self._glue:
            with _GLUE_LOCK:
                if not self._glue:
                    from tokenizers import Tokenizer

                    glue = self._reread() or Tokenizer.from_str(self.tokenizer.to_str())
                    glue.encode_special_tokens = False  # before anyone else can see it
                    self._glue.append(glue)
        return self._glue[0]

    def _reread(self) -> Tokenizer | None:
        """The tokenizer read again from its file if that is unchanged since the load: the
        same tokenizer as a copy through `to_str`, which holds the GIL (the feed's start
        stalled on it); `from_file` lets go of it while it parses (`read_text` + `from_str`
        and `from_buffer` do not)."""
        path = self._unchanged_source()
        if path is None:
            return None  # rewritten since: copy the loaded one instead
        from tokenizers import Tokenizer

        glue = Tokenizer.from_file(str(path))
        return glue if self._unchanged_source() is not None else None

    def _unchanged_source(self) -> Path | None:
        """The tokenizer.json `tokenizer` was read from, if its (size, mtime) are as at the
        load; else None (none, gone, or rewritten since)."""
        if self.source is None:
            return None
        path, seen = self.source
        try:
            st = path.stat()
        except OSError:
            return None
        return path if (st.st_size, st.st_mtime_ns) == seen else None

    def glue_in_background(self) -> None:
        """Start building the glue copy (`with_specials`) on a thread, for a feed with a chat
        stream: its first unit then finds it made, instead of the first step waiting for it
        (the parse lets go of the GIL, so it runs beside the feed's start). Not where a glue
        file holds this tokenizer's glue already (`encode_glue`): likely no copy is needed."""
        path = self._glue_file()
        if not self._glue and not (path is not None and path.exists()):
            threading.Thread(target=self.with_specials, name="tokenmill-glue", daemon=True).start()

    def encode_glue(self, texts: list[str]) -> list[list[int]]:
        """Chat template glue as ids, special tokens recognised (the glue copy's encoding).

        A template's glue is a handful of distinct strings ("<|im_start|>user\n", ...): each
        is encoded once and kept, in this process and in a file under the cache directory
        named by the tokenizer file's sha256 and the tokenizers version, so that the next
        process (a worker, a service's actor) reads them instead of building the glue copy
        (~0.45 CPU-s and ~50 MB for cl100k). A text it lacks is encoded by the copy, as
        before. The ids are the copy's own: the file only remembers them. Past GLUE_KEEP
        texts (a template whose glue varies with the records) nothing more is kept."""
        ids = self._glue_ids
        with _GLUE_IDS_LOCK:
            if not ids:
                ids.update(self._read_glue_file())
            missing = list(dict.fromkeys(t for t in texts if t not in ids))
        if not missing:
            return [ids[t] for t in texts]
        glue = self.with_specials()
        fast = getattr(glue, "encode_batch_fast", glue.encode_batch)
        made = {
            t: e.ids for t, e in zip(missing, fast(missing, add_special_tokens=False), strict=True)
        }
        with _GLUE_IDS_LOCK:
            if len(ids) + len(made) <= GLUE_KEEP:
                ids.update(made)
                self._write_glue_file(ids)
        return [made[t] if t in made else ids[t] for t in texts]

    def _glue_file(self) -> Path | None:
        """Where this tokenizer's glue ids persist; None unless it was read from a file that
        is unchanged since (its sha256 names the file, with the tokenizers version)."""
        if not self._glue_key:
            path = self._unchanged_source()
            if path is None:
                return None
            import tokenizers

            from pipeline.config import file_digest  # cached: the config hash computed it

            try:
                digest = file_digest(path)[:32]
            except OSError:
                return None
            self._glue_key.append(f"{digest}-tokenizers{tokenizers.__version__}")
        from pipeline.tokenize.files import cache_dir

        return cache_dir() / "glue" / f"{self._glue_key[0]}.json"

    def _read_glue_file(self) -> dict[str, list[int]]:
        path = self._glue_file()
        try:
            found = json.loads(path.read_text(encoding="utf-8")) if path is not None else {}
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: encoded afresh (and written again)
        ok = isinstance(found, dict) and all(
            isinstance(v, list) and all(isinstance(i, int) for i in v) for v in found.values()
        )
        return found if ok else {}

    def _write_glue_file(self, ids: dict[str, list[int]]) -> None:
        path = self._glue_file()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(ids), encoding="utf-8")
            os.replace(tmp, path)  # whole or not at all, whoever writes at the same time
        except OSError:
            pass  # a read-only cache: kept in this process only

    def describe(self) -> str:
        """One line on what was loaded, for `tokenmill check`."""

        def token(i: int | None) -> str:
            return "none" if i is None else f"{i} {self.tokenizer.id_to_token(i)!r}"

        if self.fast is not None:
            classes = self.guarantees.split_classes if self.guarantees else "not checked"
            backend = (
                f"{self.fast.name} where exact (BPE proven, split classes {classes}, "
                "split structure sampled)"
            )
        elif self.guarantees is not None:
            why = self.guarantees.failed or self.guarantees.pretokenizer
            backend = f"hf (no fast engine is exact: {why})"
        else:
            backend = "hf"
        return (
            f"tokenizer {self.name}: {self.vocab_size} ids,"
            f" bos {token(self.bos_id)} (add_bos {str(self.add_bos).lower()}), eos "
            f"{token(self.eos_id)} (add_eos {str(self.add_eos).lower()}), pad {self.pad_id}, "
            f"{'a' if self.chat_template else 'no'} chat template, backend {backend}"
        )

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode a batch with the HF tokenizer: (flat int32 ids, int64 offsets)."""
        return _flatten(_hf_ids(self.tokenizer, texts))

    def encode_verified(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """Encode a batch with the fastest exact backend: (flat, offsets, backend code).

        The fast backend's ids are kept only if a sample of this batch (`verify_sample`: whole
        texts, or a window of a long one) encodes identically with the HF tokenizer; otherwise
        HF re-encodes the batch.

        The fast backend exists only where `prove_fast` proved its BPE exact, and a batch
        with a text holding a code point where the engines' character classes differ goes to
        HF whole (`SplitGuard`, `hf_split`), so a difference here could only come from the
        regex's structure (or a Unicode normalizer): that is all the sample checks. Its budget
        stays `verify_fraction` (default 1% of the characters): regex disagreements are rare
        and input-shaped (cl100k's digit-run trap touched 0.03% of tokens, only on some files),
        so a batch must be sampled at all to be caught. Its cost is not small: HF is ~20-30x
        slower per token than fastokens, so 1% of the characters costs ~20-35% of the fast
        path's time (documents of 10k characters: 11.4M tokens/s verified, 17.9M fastokens
        alone, this VM). Exactness first: a smaller `verify_fraction` buys that time back.
        """
        if self.fast is None or not texts:
            return *self.encode(texts), BACKEND_HF
        if self.split_guard is not None and self.split_guard.hits(texts):
            return *self.encode(texts), BACKEND_HF_SPLIT
        flat, offsets = self.fast.encode_flat(texts)
        picked = verify_sample(texts, self.verify_fraction)
        pieces = [texts[i][a:b] for i, a, b in picked]
        reference = _hf_ids(self.tokenizer, pieces)
        for (i, a, b), piece, want in zip(picked, pieces, reference, strict=True):
            whole = a == 0 and b == len(texts[i])
            got = flat[offsets[i] : offsets[i + 1]] if whole else self.fast.encode_flat([piece])[0]
            if got.tolist() != want:
                if self.backend != "auto":
                    raise FastBackendError(
                        f"tokenizer.backend {self.backend}: differs from {self.name!r} on a "
                        f"text starting {piece[:60]!r}; use backend auto or hf"
                    )
                return *self.encode(texts), BACKEND_HF_FALLBACK
        return flat, offsets, self.fast.code

    def encode_records(
        self, texts: list[str]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        """`encode_verified` per record: (flat, offsets, int8 backend per text, {index:
        reason}), where a text the tokenizer fails on is one failed record, without ids.

        A text holding a code point the split guard names goes to HF alone (`hf_split`), the
        others to `encode_verified` as one call: one such text does not send its whole batch
        to HF. Both parts are functions of the texts alone, so the output is too.
        """
        guard = self.split_guard if self.fast is not None else None
        to_hf = [i for i, t in enumerate(texts) if guard is not None and guard.hits([t])]
        if not to_hf:
            return self._encode_isolating(texts, self.encode_verified)
        ids: list = [None] * len(texts)
        backends = np.zeros(len(texts), dtype=np.int8)
        failed: dict[int, str] = {}
        rest = [i for i in range(len(texts)) if i not in set(to_hf)]
        for part, encode in ((to_hf, self._encode_split_guarded), (rest, self.encode_verified)):
            if not part:
                continue
            flat, offsets, codes, bad = self._encode_isolating([texts[i] for i in part], encode)
            for k, i in enumerate(part):
                ids[i] = flat[offsets[k] : offsets[k + 1]]
                backends[i] = codes[k]
                if k in bad:
                    failed[i] = bad[k]
        return *_flatten(ids), backends, failed

    def _encode_split_guarded(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        return *self.encode(texts), BACKEND_HF_SPLIT

    def _encode_isolating(
        self, texts: list[str], encode: Callable[[list[str]], tuple[np.ndarray, np.ndarray, int]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        """`encode(texts)`, where a text the tokenizer fails on is one failed record.

        The batch is encoded as one call first. If that fails (`tokenizer_failure`), each
        text is encoded alone, by the fast engine where `encode` uses one, to find the
        culprits; the others are encoded as one call again (the same texts give the same
        call, so the output is still a function of the texts alone). A culprit of the fast
        engine gets the HF tokenizer's exact ids if HF can encode it (`hf_fallback`), else it
        fails. If every text of a batch of several fails alone, the failure is not the
        records': it is raised.
        """
        try:
            flat, offsets, backend = encode(texts)
            return flat, offsets, np.full(len(texts), backend, dtype=np.int8), {}
        except BaseException as e:
            if not tokenizer_failure(e):
                raise
            first = e
        fast = self.fast if encode == self.encode_verified else None
        alone = fast.encode_flat if fast is not None else self.encode
        culprits: dict[int, BaseException] = {}
        for i, text in enumerate(texts):
            try:
                alone([text])
            except BaseException as e:
                if not tokenizer_failure(e):
                    raise
                culprits[i] = e
        if len(texts) > 1 and len(culprits) == len(texts):
            raise first
        ids: dict[int, np.ndarray] = {}
        backends = np.zeros(len(texts), dtype=np.int8)
        failed: dict[int, str] = {}
        for i, error in culprits.items():
            reason = f"the tokenizer failed on this record: {failure_reason(error)}"
            if fast is not None:
                try:
                    ids[i] = self.encode([texts[i]])[0]
                    backends[i] = BACKEND_HF_FALLBACK
                    continue
                except BaseException as hf_error:
                    if not tokenizer_failure(hf_error):
                        raise
                    reason += f"; HF's too: {failure_reason(hf_error)}"
            failed[i] = reason
            ids[i] = np.zeros(0, dtype=np.int32)
        rest = [i for i in range(len(texts)) if i not in culprits]
        if rest:
            flat, offsets, backend = encode([texts[i] for i in rest])
            for k, i in enumerate(rest):
                ids[i] = flat[offsets[k] : offsets[k + 1]]
                backends[i] = backend
        flat, offsets = _flatten([ids[i] for i in range(len(texts))])
        return flat, offsets, backends, failed


def tokenizer_failure(e: BaseException) -> bool:
    """Whether `e` is a tokenizer failing on its input, to be charged to the record.

    Any Exception (fastokens: "ValueError: ... PCRE2: match limit exceeded" on 10 MB of
    spaces), and a Rust panic: PyO3 raises `pyo3_runtime.PanicException`, a BaseException
    (HF's Oniguruma: "retry-limit-in-match over"). Matched by type name, as PyO3 exposes the
    class nowhere importable; KeyboardInterrupt, SystemExit and the like stay what they are.
    """
    if isinstance(e, Exception):
        return True
    kind = type(e)
    return kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"


def failure_reason(e: BaseException) -> str:
    """A record's reject reason for tokenizer failure `e`: its type and first line, short."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"


def _probe_fast(tok, fast: FastEncoder, guard: SplitGuard | None = None) -> str | None:
    """None if the fast encoder matches HF on FAST_PROBE, else the first differing text.
    Texts the guard sends to HF are not the fast encoder's to match."""
    for text, want in zip(FAST_PROBE, _hf_ids(tok, list(FAST_PROBE)), strict=True):
        if guard is not None and guard.hits([text]):
            continue
        if fast.encode([text])[0] != want:
            return text
    return None


def _split_guard(form: BpeForm, fast: FastEncoder) -> tuple[SplitGuard | None, str]:
    """The guard of `fast`'s split (None: nothing to guard), and `split_classes` to report."""
    patterns = (form.pattern, form.hf_pattern or form.pattern)
    differ = split_exceptions(patterns, fast.name)
    if differ is None:
        return None, "not checked"
    if not differ:
        return None, "proven"
    guard = SplitGuard(differ, form.normalize)
    return guard, guard.describe()


def _fast_backend(
    tok, cfg: TokenizerConfig, source: Path | None, preloaded: Callable | None = None
) -> tuple[FastEncoder | None, FastGuarantees | None, SplitGuard | None]:
    """The fast encoder where it may be used, what was proven about it, and its split guard.

    (None, None): the tokenizer has no byte-level BPE form. (None, guarantees): a proof or
    the regex probe failed (or no engine is installed). Under `backend: tiktoken` or
    `fastokens` each of these raises FastBackendError instead. Under `auto` the engines are
    tried fastest first (`ENGINES`): one whose probe differs gives way to the next.
    `source`: the tokenizer.json file `tok` was loaded from (None: serialize `tok`).
    `preloaded`: returns the fastokens engine, built on a thread during the HF load.
    """
    strict = cfg.backend if cfg.backend in ("tiktoken", "fastokens") else None
    default = cfg.name == "default"
    content = source.read_bytes() if source is not None else tok.to_str().encode()
    doc = functools.cache(lambda: json.loads(content))  # 0.2 s on cl100k: only if needed
    form = _bpe_form(None if default else doc(), default)
    if form is None:
        if strict:
            raise FastBackendError(
                f"tokenizer.backend {strict}: not exact for {cfg.name!r} (it has no byte-level "
                "BPE form: a BPE model behind one Split regex or ByteLevel); use backend auto or hf"
            )
        return None, None, None
    ranks_source = f"cl100k-{CL100K_SHA256[:12]}" if default else "vocab"
    guarantees = prove_cached(content, ranks_source, lambda: prove_fast(doc(), form.ranks()))
    if not guarantees.proven:
        if strict:
            raise FastBackendError(
                f"tokenizer.backend {strict}: not exact for {cfg.name!r}, a guarantee failed: "
                f"{guarantees.failed}; use backend auto or hf"
            )
        return None, guarantees, None
    differs = None
    for engine in ENGINES[cfg.backend]:
        fast = preloaded() if preloaded and engine is _fastokens_engine else engine(form)
        if fast is None:
            continue
        guard, split_classes = _split_guard(form, fast)
        bad = _probe_fast(tok, fast, guard)
        if bad is None:
            return fast, replace(guarantees, split_classes=split_classes), guard
        differs = differs or bad
    if strict:
        why = (
            f"the {strict} package is not installed here, or cannot load {cfg.name!r}"
            if differs is None
            else f"not exact for {cfg.name!r} (its pre-tokenizer differs on {differs[:60]!r})"
        )
        raise FastBackendError(f"tokenizer.backend {strict}: {why}; use backend auto or hf")
    why = "failed probe" if differs is not None else "no engine installed"
    return None, replace(guarantees, pretokenizer=why), None


def _preload_fastokens(cfg: TokenizerConfig) -> Callable | None:
    """For the default tokenizer, build the fastokens engine on a thread while HF's loads; a
    callable that joins and returns it. None where nothing is preloaded.

    fastokens' load releases the GIL and HF's holds it, so the thread is let reach the native
    call before HF's load starts (started the other way round, it waited out HF's load for
    the GIL): on 2 cores the pair then costs about one load's wall time."""
    if cfg.name != "default" or _fastokens_engine not in ENGINES.get(cfg.backend, ()):
        return None
    form = _bpe_form(None, True)
    assert form is not None
    result: list = [None]
    entering = threading.Event()

    def build() -> None:
        result[0] = _fastokens_engine(form, entering)

    thread = threading.Thread(target=build, daemon=True, name="tokenmill-fastokens-load")
    thread.start()
    entering.wait(5.0)

    def join():
        thread.join()
        return result[0]

    return join


# Loaded tokenizers by config and content (`tokenizer_digest`). Written under _LOADING only;
# read without it (a dict lookup is atomic, and entries are immutable and never removed).
_CACHE: dict[tuple[TokenizerConfig, str | None], LoadedTokenizer] = {}
_LOADING = threading.Lock()


def load_tokenizer(cfg: TokenizerConfig) -> LoadedTokenizer:
    """Load a tokenizer once per process (module-level cache; workers import this module).

    Once, also when several threads ask at the same moment (the feed and its head start
    did, and paid the ~0.7 s load twice on the same two cores). Keyed by the tokenizer's
    content as well as its config: a warm pool actor outlives exports, and a tokenizer.json
    rewritten under the same path between two of them is loaded afresh (it kept encoding
    with the old one: 756 of 4,123 tokens differed)."""
    key = (cfg, tokenizer_digest(cfg.name))
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    with _LOADING:
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = _load_tokenizer(cfg)
        return hit


def _first_or(default: int, *ids: int | None) -> int:
    return next((i for i in ids if i is not None), default)


def _load_tokenizer(cfg: TokenizerConfig) -> LoadedTokenizer:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    preloaded = _preload_fastokens(cfg)
    if cfg.name == "default":
        source: Path | None = default_tokenizer_file()
        eot = CL100K_SPECIALS["<|endoftext|>"]
        found = TokenizerFile(
            Tokenizer.from_file(str(source)), source, None, eot, eot, False, DEFAULT_CHAT_TEMPLATE
        )
    else:
        found = open_tokenizer(cfg.name)
    tok, source = found.tokenizer, found.source
    template = cfg.chat_template or found.chat_template
    # Text is text: a literal "<|endoftext|>" inside a document must not become EOS. Special
    # tokens enter only where the config says (add_bos/add_eos) or a chat template puts them.
    tok.encode_special_tokens = True
    bos = cfg.bos_id if cfg.bos_id is not None else found.bos_id
    eos = cfg.eos_id if cfg.eos_id is not None else found.eos_id
    pad = cfg.pad_id if cfg.pad_id is not None else _first_or(0, found.pad_id, eos)
    add_bos = cfg.add_bos if cfg.add_bos is not None else found.add_bos
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for key, value in (("bos_id", cfg.bos_id), ("eos_id", cfg.eos_id), ("pad_id", cfg.pad_id)):
        if value is not None and value >= vocab:
            raise ValueError(
                f"tokenizer.{key}: {value} is not an id of {cfg.name!r} (its vocabulary has "
                f"{vocab} ids, 0..{vocab - 1})"
            )
    if add_bos and bos is None:
        raise ValueError(f"tokenizer.add_bos: {cfg.name!r} has no BOS token; set tokenizer.bos_id")
    if cfg.add_eos and eos is None:
        why = (
            f"its special tokens {list(found.eos_candidates)} could each be it"
            if found.eos_candidates
            else "it declares none"
        )
        raise ValueError(
            f"tokenizer.add_eos: cannot tell the EOS token of {cfg.name!r} ({why}); "
            "set tokenizer.eos_id"
        )
    fast = guarantees = guard = None
    if cfg.backend != "hf":
        fast, guarantees, guard = _fast_backend(tok, cfg, source, preloaded)
    loaded = LoadedTokenizer(
        tok,
        bos,
        eos,
        pad,
        add_bos,
        cfg.add_eos,
        template,
        cfg.name,
        fast=fast,
        backend=cfg.backend,
        verify_fraction=cfg.verify_fraction,
        guarantees=guarantees,
        split_guard=guard,
        source=_stamp(source),
        vocab_size=vocab,
    )
    return loaded


def _stamp(source: Path | None) -> tuple[Path, tuple[int, int]] | None:
    """`source` with its (size, mtime_ns) now (LoadedTokenizer.source), None if unreadable."""
    if source is None:
        return None
    try:
        st = source.stat()
    except OSError:
        return None
    return source, (st.st_size, st.st_mtime_ns)
