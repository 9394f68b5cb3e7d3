"""Tokenizers: loading once per worker process, and batched encoding into flat numpy arrays.

Where the tokenizer.json comes from (the offline cl100k default, a file, the Hub cache) is
`pipeline.tokenizer_files`; the proofs behind the fast backend are `pipeline.proofs`.

The HF tokenizer is the reference: its ids are the ids. An optional *fast backend* encodes
instead where it is exact. It is rank-order BPE over the tokenizer's own ranks behind its own
split regex, run by one of two engines: `fastokens` (Rust BPE, PCRE2's JIT for the split: ~5x
tiktoken on one core here, ~18x HF) where its wheel is installed, else tiktoken (~3.5x HF).
Exactness is proven where it can be: at load, `prove_fast` checks over the whole vocabulary and
merge list that rank-order BPE over these ranks and the HF BPE model give the same ids on every
pre-token (the verdict is cached on disk by the tokenizer.json's sha256); both engines
implement rank-order BPE. What cannot be proven is the split into pre-tokens: the libraries run
the same regex on different engines (Oniguruma; fancy-regex or PCRE2). That is sampled: a fixed
probe set at load, then a byte-proportional sample of every encode call is also encoded by the
HF tokenizer and compared; any mismatch sends that whole call to the HF tokenizer (or is an
error under ``tokenizer.backend: tiktoken`` or ``fastokens``). The decision is a function of the
call's texts only, so output stays deterministic whichever process encodes it.
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
from pipeline.proofs import FastGuarantees, byte_level_vocab, prove_cached, prove_fast
from pipeline.tokenizer_files import (
    CL100K_SHA256,
    CL100K_SPECIALS,
    TokenizerFile,
    cache_dir,
    cl100k_ranks_file,
    default_tokenizer_file,
    open_tokenizer,
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
)


# Which backend encoded a batch: blocks carry it per row, the feed reports tokens per name.
# `pretokenized`: ids read as they are from an export (format: export), no tokenizer ran.
BACKEND_HF, BACKEND_FAST, BACKEND_HF_FALLBACK, BACKEND_NONE, BACKEND_FASTOKENS = 0, 1, 2, 3, 4
BACKEND_NAMES = ("hf", "tiktoken", "hf_fallback", "pretokenized", "fastokens")


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


def _fast_encoder_from_hf(doc: dict | None, default: bool) -> FastEncoder | None:
    """The tiktoken encoder of a byte-level BPE tokenizer (`_bpe_form`), or None."""
    form = _bpe_form(doc, default)
    return None if form is None else _tiktoken_engine(form)


def _hf_ids(tok, texts: list[str]) -> list[list[int]]:
    fast = getattr(tok, "encode_batch_fast", None)  # skips offset tracking where available
    return [e.ids for e in (fast or tok.encode_batch)(texts, add_special_tokens=False)]


def _flatten(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    for i, x in enumerate(ids):
        flat[offsets[i] : offsets[i + 1]] = x
    return flat, offsets


def verify_sample(texts: list[str], fraction: float) -> list[int]:
    """Indices of the texts to check against HF: about `fraction` of the characters.

    Every k-th text (k = 1/fraction) from the first is taken while the character budget
    (`fraction` of the batch) lasts; if none fits, the shortest text is. So the check costs
    about `fraction` of an HF encode whatever the document sizes, spreads over the batch, and
    is a pure function of it (the same batch is always checked the same way).
    """
    if not texts:
        return []
    budget = fraction * sum(len(t) for t in texts)
    picked, used = [], 0
    for i in range(0, len(texts), max(1, round(1 / fraction))):
        if used + len(texts[i]) <= budget:
            picked.append(i)
            used += len(texts[i])
    return picked or [min(range(len(texts)), key=lambda i: len(texts[i]))]


class FastBackendError(ValueError):
    """`tokenizer.backend: tiktoken` (or `fastokens`) was asked for, and it is not exact here."""


@dataclass(frozen=True)
class LoadedTokenizer:
    """A `tokenizers.Tokenizer` plus the special ids the pipeline needs.

    `guarantees`: what was proven about the fast backend at load (`FastGuarantees`), or None
    where none was considered (backend hf, or no byte-level BPE form).
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

    def describe(self) -> str:
        """One line on what was loaded, for `tokenmill check`."""

        def token(i: int | None) -> str:
            return "none" if i is None else f"{i} {self.tokenizer.id_to_token(i)!r}"

        if self.fast is not None:
            backend = f"{self.fast.name} where exact (BPE proven, split sampled)"
        elif self.guarantees is not None:
            why = self.guarantees.failed or self.guarantees.pretokenizer
            backend = f"hf (no fast engine is exact: {why})"
        else:
            backend = "hf"
        return (
            f"tokenizer {self.name}: {self.tokenizer.get_vocab_size(with_added_tokens=True)} ids,"
            f" bos {token(self.bos_id)} (add_bos {str(self.add_bos).lower()}), eos "
            f"{token(self.eos_id)} (add_eos {str(self.add_eos).lower()}), pad {self.pad_id}, "
            f"{'a' if self.chat_template else 'no'} chat template, backend {backend}"
        )

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode a batch with the HF tokenizer: (flat int32 ids, int64 offsets)."""
        return _flatten(_hf_ids(self.tokenizer, texts))

    def encode_verified(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """Encode a batch with the fastest exact backend: (flat, offsets, backend code).

        The fast backend's ids are kept only if a sample of this batch (`verify_sample`)
        encodes identically with the HF tokenizer; otherwise HF re-encodes the batch.

        The fast backend exists only where `prove_fast` proved its BPE exact, so a difference
        here can only come from the regex split (or a Unicode normalizer): that is all the
        sample checks. Its budget stays `verify_fraction` (default 1% of the characters, about
        6% of the fast path's time, HF being ~6x slower): regex disagreements are rare and
        input-shaped (cl100k's digit-run trap touched 0.03% of tokens, only on some files), so
        a batch must be sampled at all to be caught, and a smaller share saves little.
        """
        if self.fast is None or not texts:
            return *self.encode(texts), BACKEND_HF
        flat, offsets = self.fast.encode_flat(texts)
        picked = verify_sample(texts, self.verify_fraction)
        reference = _hf_ids(self.tokenizer, [texts[i] for i in picked])
        for i, want in zip(picked, reference, strict=True):
            if flat[offsets[i] : offsets[i + 1]].tolist() != want:
                if self.backend != "auto":
                    raise FastBackendError(
                        f"tokenizer.backend {self.backend}: differs from {self.name!r} on a "
                        f"text starting {texts[i][:60]!r}; use backend auto or hf"
                    )
                return *self.encode(texts), BACKEND_HF_FALLBACK
        return flat, offsets, self.fast.code


def _probe_fast(tok, fast: FastEncoder) -> str | None:
    """None if the fast encoder matches HF on FAST_PROBE, else the first differing text."""
    for text, want in zip(FAST_PROBE, _hf_ids(tok, list(FAST_PROBE)), strict=True):
        if fast.encode([text])[0] != want:
            return text
    return None


def _fast_backend(
    tok, cfg: TokenizerConfig, source: Path | None, preloaded: Callable | None = None
) -> tuple[FastEncoder | None, FastGuarantees | None]:
    """The fast encoder where it may be used, and what was proven about it.

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
        return None, None
    ranks_source = f"cl100k-{CL100K_SHA256[:12]}" if default else "vocab"
    guarantees = prove_cached(content, ranks_source, lambda: prove_fast(doc(), form.ranks()))
    if not guarantees.proven:
        if strict:
            raise FastBackendError(
                f"tokenizer.backend {strict}: not exact for {cfg.name!r}, a guarantee failed: "
                f"{guarantees.failed}; use backend auto or hf"
            )
        return None, guarantees
    differs = None
    for engine in ENGINES[cfg.backend]:
        fast = preloaded() if preloaded and engine is _fastokens_engine else engine(form)
        if fast is None:
            continue
        bad = _probe_fast(tok, fast)
        if bad is None:
            return fast, guarantees
        differs = differs or bad
    if strict:
        why = (
            f"the {strict} package is not installed here, or cannot load {cfg.name!r}"
            if differs is None
            else f"not exact for {cfg.name!r} (its pre-tokenizer differs on {differs[:60]!r})"
        )
        raise FastBackendError(f"tokenizer.backend {strict}: {why}; use backend auto or hf")
    why = "failed probe" if differs is not None else "no engine installed"
    return None, replace(guarantees, pretokenizer=why)


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


_CACHE: dict[TokenizerConfig, LoadedTokenizer] = {}
_LOADING = threading.Lock()


def load_tokenizer(cfg: TokenizerConfig) -> LoadedTokenizer:
    """Load a tokenizer once per process (module-level cache; workers import this module).

    Once, also when several threads ask at the same moment (the feed and its head start
    did, and paid the ~0.7 s load twice on the same two cores)."""
    hit = _CACHE.get(cfg)
    if hit is not None:
        return hit
    with _LOADING:
        hit = _CACHE.get(cfg)
        return hit if hit is not None else _load_tokenizer(cfg)


def _first_or(default: int, *ids: int | None) -> int:
    return next((i for i in ids if i is not None), default)


def _load_tokenizer(cfg: TokenizerConfig) -> LoadedTokenizer:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    preloaded = _preload_fastokens(cfg)
    if cfg.name == "default":
        from pipeline.chat import DEFAULT_CHAT_TEMPLATE

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
    fast = guarantees = None
    if cfg.backend != "hf":
        fast, guarantees = _fast_backend(tok, cfg, source, preloaded)
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
    )
    _CACHE[cfg] = loaded
    return loaded
