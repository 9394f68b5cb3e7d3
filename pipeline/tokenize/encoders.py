"""The fast backend's encoders: rank-order BPE over a tokenizer's own ranks behind its own
split regex, on fastokens (Rust BPE, PCRE2's JIT) or tiktoken, and how one is chosen, proven
and guarded for a tokenizer.json (`fast_backend`).

- `bpe_form`: whether a tokenizer.json is a byte-level BPE these engines can run (its ranks,
  split pattern and normal form), else None;
- `FastEncoder`/`FastokensEncoder`: batched encoding into flat numpy arrays;
- `SplitGuard`: texts holding a code point where the regex engines' classes differ go to HF;
- `verify_sample`: the byte-proportional sample of each call that HF also encodes;
- `fast_backend`: the engine built, proven (pipeline/tokenize/proofs.py) and probed.

`LoadedTokenizer` (pipeline/tokenize/engines.py) holds the chosen encoder beside the HF
tokenizer, the reference.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from pipeline.config import TokenizerConfig
from pipeline.tokenize.files import (
    CL100K_HF_PATTERN,
    CL100K_SHA256,
    cache_dir,
    cl100k_ranks_file,
)
from pipeline.tokenize.proofs import (
    FastGuarantees,
    byte_level_vocab,
    prove_cached,
    prove_fast,
    split_exceptions,
)

if TYPE_CHECKING:
    pass


# Which backend encoded a batch: blocks carry it per row, the feed reports tokens per name.
# `pretokenized`: ids read as they are from an export (format: export), no tokenizer ran.
# `hf_split`: texts holding a code point on which the fast split is not proven (SplitGuard).
BACKEND_HF, BACKEND_FAST, BACKEND_HF_FALLBACK, BACKEND_NONE, BACKEND_FASTOKENS = 0, 1, 2, 3, 4
BACKEND_HF_SPLIT = 5
BACKEND_NAMES = ("hf", "tiktoken", "hf_fallback", "pretokenized", "fastokens", "hf_split")

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
        return flatten(self.encode(texts))


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


def bpe_form(doc: dict | None, default: bool) -> BpeForm | None:
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


def tiktoken_engine(form: BpeForm) -> FastEncoder | None:
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


def fastokens_engine(
    form: BpeForm, entering: threading.Event | None = None
) -> FastokensEncoder | None:
    """fastokens over `form`, or None (no wheel for this platform; a pattern PCRE2 refuses).
    `entering` is set just before the native load (see `preload_fastokens`), and on return."""
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
    "auto": (fastokens_engine, tiktoken_engine),
    "fastokens": (fastokens_engine,),
    "tiktoken": (tiktoken_engine,),
}


def hf_ids(tok, texts: list[str]) -> list[list[int]]:
    fast = getattr(tok, "encode_batch_fast", None)  # skips offset tracking where available
    return [e.ids for e in (fast or tok.encode_batch)(texts, add_special_tokens=False)]


def flatten(ids: list) -> tuple[np.ndarray, np.ndarray]:
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


def probe_fast(tok, fast: FastEncoder, guard: SplitGuard | None = None) -> str | None:
    """None if the fast encoder matches HF on FAST_PROBE, else the first differing text.
    Texts the guard sends to HF are not the fast encoder's to match."""
    for text, want in zip(FAST_PROBE, hf_ids(tok, list(FAST_PROBE)), strict=True):
        if guard is not None and guard.hits([text]):
            continue
        if fast.encode([text])[0] != want:
            return text
    return None


def split_guard(form: BpeForm, fast: FastEncoder) -> tuple[SplitGuard | None, str]:
    """The guard of `fast`'s split (None: nothing to guard), and `split_classes` to report."""
    patterns = (form.pattern, form.hf_pattern or form.pattern)
    differ = split_exceptions(patterns, fast.name)
    if differ is None:
        return None, "not checked"
    if not differ:
        return None, "proven"
    guard = SplitGuard(differ, form.normalize)
    return guard, guard.describe()


def fast_backend(
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
    form = bpe_form(None if default else doc(), default)
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
        fast = preloaded() if preloaded and engine is fastokens_engine else engine(form)
        if fast is None:
            continue
        guard, split_classes = split_guard(form, fast)
        bad = probe_fast(tok, fast, guard)
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


def preload_fastokens(cfg: TokenizerConfig) -> Callable | None:
    """For the default tokenizer, build the fastokens engine on a thread while HF's loads; a
    callable that joins and returns it. None where nothing is preloaded.

    fastokens' load releases the GIL and HF's holds it, so the thread is let reach the native
    call before HF's load starts (started the other way round, it waited out HF's load for
    the GIL): on 2 cores the pair then costs about one load's wall time."""
    if cfg.name != "default" or fastokens_engine not in ENGINES.get(cfg.backend, ()):
        return None
    form = bpe_form(None, True)
    assert form is not None
    result: list = [None]
    entering = threading.Event()

    def build() -> None:
        result[0] = fastokens_engine(form, entering)

    thread = threading.Thread(target=build, daemon=True, name="tokenmill-fastokens-load")
    thread.start()
    entering.wait(5.0)

    def join():
        thread.join()
        return result[0]

    return join
