"""What a `tokenizer.name` loads, and what the tokenizer's own files decide when the config
is silent: EOS, BOS and add_bos; SentencePiece models; Hub names that are not cached."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import TokenizerConfig
from pipeline.read.resolve import parse_config
from pipeline.tokenize.engines import load_tokenizer
from pipeline.tokenize.files import DOWNLOAD_ENV, sentencepiece_tokenizer_file
from tests.conftest import stdlib_texts
from tests.rayhead import patient

WORDS = ["hello", "world", "a", "b", "the", "<", ">", "s", "/", "|"]


def _write_tokenizer(
    path: Path, specials=(), plain=(), template: str | None = None, config: dict | None = None
) -> str:
    """A tiny word-level tokenizer.json: WORDS, then `specials` (special added tokens) and
    `plain` (non-special added tokens); `template` a post-processor like "<s> $A"."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]", *WORDS])}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.add_tokens([AddedToken(t, special=False) for t in plain])
    if template is not None:
        names = [t for t in template.split() if t != "$A"]
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, tok.token_to_id(t)) for t in names]
        )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path / "tokenizer.json")


def _load(name: str, **kw):
    return load_tokenizer(TokenizerConfig(name=name, backend="hf", **kw))


def _id(tok, text: str) -> int:
    return tok.tokenizer.token_to_id(text)


# --- EOS from a bare tokenizer.json ---


@pytest.mark.parametrize(
    "specials, eos",
    [
        (["<|endoftext|>"], "<|endoftext|>"),
        (["</s>", "<s>", "<pad>"], "</s>"),
        # A document end beats a turn end (Qwen2's and cl100k's files carry both).
        (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>"),
        (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], "<|end_of_text|>"),
        (["<|im_start|>", "<|im_end|>"], "<|im_end|>"),  # only a turn end: that one
    ],
)
def test_a_bare_tokenizer_json_gets_its_unambiguous_eos(tmp_path, specials, eos):
    tok = _load(_write_tokenizer(tmp_path, specials))
    assert tok.eos_id == _id(tok, eos) and tok.add_eos
    assert tok.pad_id == tok.eos_id  # no pad token declared: EOS pads, as before


@pytest.mark.parametrize(
    "specials, candidates",
    [
        (["</s>", "<|endoftext|>"], ["</s>", "<|endoftext|>"]),
        (["<|im_end|>", "<|eot_id|>"], ["<|im_end|>", "<|eot_id|>"]),
    ],
)
def test_an_ambiguous_eos_is_refused_with_the_candidates(tmp_path, specials, candidates):
    name = _write_tokenizer(tmp_path, specials)
    with pytest.raises(ValueError) as e:
        _load(name)
    assert "tokenizer.add_eos: cannot tell the EOS token" in str(e.value)
    assert str(candidates) in str(e.value) and "set tokenizer.eos_id" in str(e.value)
    # An explicit id settles it; without add_eos nothing needs settling.
    assert _load(name, eos_id=len(WORDS) + 1).eos_id == len(WORDS) + 1
    assert _load(name, add_eos=False).eos_id is None


def test_no_eos_at_all_says_so(tmp_path):
    # A non-special added "</s>" is text, not a candidate.
    name = _write_tokenizer(tmp_path, ["<pad>"], plain=["</s>"])
    with pytest.raises(ValueError, match=r"'.*tokenizer.json' \(it declares none\)"):
        _load(name)


def test_declared_eos_beats_guessing(tmp_path):
    """The post-processor's trailing token (T5's "$A </s>"), then tokenizer_config.json's
    eos_token, win over the names, which would be ambiguous here."""
    specials = ["</s>", "<|endoftext|>"]
    tok = _load(_write_tokenizer(tmp_path / "t5", specials, template="$A </s>"))
    assert tok.eos_id == _id(tok, "</s>")
    cfg = {"eos_token": {"content": "<|endoftext|>"}, "pad_token": "</s>"}
    tok = _load(_write_tokenizer(tmp_path / "cfg", specials, config=cfg))
    assert tok.eos_id == _id(tok, "<|endoftext|>") and tok.pad_id == _id(tok, "</s>")


# --- add_bos: the tokenizer's own choice unless the config says ---


def test_add_bos_follows_the_post_processor(tmp_path):
    """Llama 3's tokenizer.json declares BOS only in its template: it is found and added."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    name = _write_tokenizer(tmp_path, specials, template="<|begin_of_text|> $A")
    tok = _load(name)
    assert tok.add_bos and tok.bos_id == _id(tok, "<|begin_of_text|>")
    assert tok.eos_id == _id(tok, "<|end_of_text|>")
    assert _load(name, add_bos=False).add_bos is False  # explicit wins
    # Without a template that adds it, BOS is known by name but not added.
    plain = _load(_write_tokenizer(tmp_path / "plain", specials))
    assert not plain.add_bos and plain.bos_id == _id(plain, "<|begin_of_text|>")
    assert _load(plain.name, add_bos=True).add_bos


def test_add_bos_follows_tokenizer_config(tmp_path):
    specials = ["<s>", "</s>"]
    off = {"add_bos_token": False, "bos_token": "<s>"}
    tok = _load(_write_tokenizer(tmp_path / "off", specials, template="<s> $A", config=off))
    assert not tok.add_bos and tok.bos_id == _id(tok, "<s>")
    on = {"add_bos_token": True, "chat_template": "{{ bos_token }}{{ messages }}"}
    tok = _load(_write_tokenizer(tmp_path / "on", specials, config=on))
    assert tok.add_bos and tok.bos_id == _id(tok, "<s>")
    assert tok.chat_template == on["chat_template"]
    # A template that starts with something other than the declared BOS does not add BOS.
    other = {"bos_token": "<s>"}
    tok = _load(
        _write_tokenizer(tmp_path / "cls", [*specials, "[CLS]"], template="[CLS] $A", config=other)
    )
    assert not tok.add_bos and tok.bos_id == _id(tok, "<s>")


def test_the_default_tokenizer_still_adds_no_bos_and_keeps_its_hash():
    tok = load_tokenizer(TokenizerConfig())
    assert tok.add_bos is False and tok.bos_id is None and tok.eos_id == 100257
    streams = {"s": {"paths": [__file__], "format": "text"}}
    unset = parse_config({"streams": streams}).config_hash()
    assert (
        unset == parse_config({"tokenizer": {"add_bos": False}, "streams": streams}).config_hash()
    )
    assert unset != parse_config({"tokenizer": {"add_bos": True}, "streams": streams}).config_hash()


def test_describe_says_what_was_loaded(tmp_path):
    """The line `tokenmill check` prints: the resolved specials, so a guessed EOS is visible."""
    line = load_tokenizer(TokenizerConfig()).describe()
    assert line.startswith("tokenizer default: 100277 ids, bos none (add_bos false), eos 100257")
    assert "'<|endoftext|>' (add_eos true)" in line and "backend fastokens where exact" in line
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = _load(_write_tokenizer(tmp_path, specials, template="<|begin_of_text|> $A"))
    line = tok.describe()
    assert f"bos {len(WORDS) + 1} '<|begin_of_text|>' (add_bos true)" in line, line
    assert f"eos {len(WORDS) + 2} '<|end_of_text|>'" in line and "no chat template" in line


# --- Failures that are fast and say what to do ---


def test_a_hub_name_not_in_the_cache_fails_fast(monkeypatch):
    """No network, no 50 s of retries, and no transformers import (~5 s here): the local
    Hugging Face cache is looked up first."""
    monkeypatch.delenv(DOWNLOAD_ENV, raising=False)
    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        load_tokenizer(TokenizerConfig(name="tokenmill-test/not-in-any-cache"))
    took = time.perf_counter() - start
    assert took < 10, took
    msg = str(e.value)
    assert "not in the local Hugging Face cache" in msg, msg
    assert "hf download tokenmill-test/not-in-any-cache" in msg and DOWNLOAD_ENV in msg


def test_a_missing_path_says_it_is_missing(tmp_path):
    name = str(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(ValueError, match="is not a file or directory"):
        load_tokenizer(TokenizerConfig(name=name))
    with pytest.raises(ValueError, match="'tok/tokenizer.json' is not a file or directory"):
        load_tokenizer(TokenizerConfig(name="tok/tokenizer.json"))  # a valid repo id, too


def test_a_broken_tokenizer_json_names_the_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(ValueError, match=f"{bad} is not a tokenizer.json"):
        load_tokenizer(TokenizerConfig(name=str(bad)))


# --- SentencePiece models ---


def test_a_sentencepiece_model_without_the_package_is_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import fails as if absent
    model = tmp_path / "spm.model"
    model.write_bytes(b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(ValueError) as e:
        load_tokenizer(TokenizerConfig(name=str(model)))
    msg = str(e.value)
    assert f"{model} is a SentencePiece model" in msg and "pip install sentencepiece" in msg


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    """Tiny SentencePiece models trained here: Unigram, and BPE with byte fallback."""
    spm = pytest.importorskip("sentencepiece")
    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    lines = [ln for t in stdlib_texts(30) for ln in t.splitlines() if ln.strip()]
    corpus.write_text("\n".join(lines)[:300_000])
    models = {}
    for kind, fallback in (("unigram", False), ("bpe", True)):
        prefix = root / kind
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(prefix),
            vocab_size=400,
            model_type=kind,
            byte_fallback=fallback,
            minloglevel=2,
        )
        models[kind] = prefix.with_suffix(".model")
    return models


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
def test_a_sentencepiece_model_converts_once_and_encodes_like_sentencepiece(
    spm_models, kind, tmp_path, monkeypatch
):
    import hashlib

    import sentencepiece as spm

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    model = spm_models[kind]
    sp = spm.SentencePieceProcessor(model_file=str(model))
    tok = load_tokenizer(TokenizerConfig(name=str(model)))
    # Control-token text is text here too: "<s>" in a document is not BOS.
    texts = ["a <s> b </s> <unk>", "  two  spaces ", "0010 naïve 你好 🎉", *stdlib_texts(8)]
    flat, offsets = tok.encode(texts)
    for i, text in enumerate(texts):
        assert flat[offsets[i] : offsets[i + 1]].tolist() == sp.encode(text), text
    assert (tok.eos_id, tok.bos_id, tok.add_bos) == (sp.eos_id(), sp.bos_id(), False)
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    [converted] = (tmp_path / "cache" / "sentencepiece").iterdir()
    assert converted.name.startswith(digest)
    # Cached by content: a copy loads without converting, even without sentencepiece.
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    copy = tmp_path / "copy.model"
    copy.write_bytes(model.read_bytes())
    assert sentencepiece_tokenizer_file(copy) == converted / "tokenizer.json"
    again = load_tokenizer(TokenizerConfig(name=str(copy)))
    assert again.encode(texts)[0].tolist() == flat.tolist()


def test_a_hub_name_in_the_local_cache_loads_offline(tmp_path):
    """The cache-first lookup keeps cached Hub tokenizers working (a fake cache entry laid out
    as huggingface_hub does; a subprocess, so both libraries read HF_HUB_CACHE afresh)."""
    import os
    import subprocess

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--tokenmill-test--tiny"
    snapshot = repo / "snapshots" / commit
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
    }
    _write_tokenizer(snapshot, ["<s>", "</s>"], template="<s> $A", config=config)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = (
        "from pipeline.config import TokenizerConfig\n"
        "from pipeline.tokenize.engines import load_tokenizer\n"
        "t = load_tokenizer(TokenizerConfig(name='tokenmill-test/tiny', backend='hf'))\n"
        "print(t.bos_id, t.eos_id, t.add_bos, t.encode(['hello world'])[0].tolist())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", DOWNLOAD_ENV))}
    env |= {"HF_HUB_CACHE": str(tmp_path / "hub"), "TOKENMILL_CACHE": str(tmp_path / "tm")}
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=patient(120)
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ids = {w: i for i, w in enumerate(["[UNK]", *WORDS])}
    bos, eos = len(ids), len(ids) + 1
    assert r.stdout.split("\n")[-2] == f"{bos} {eos} True {[ids['hello'], ids['world']]}"
