"""The tokenizer backends: the HF reference, and the fast backend used only where it is exact."""

from __future__ import annotations

import json

import pytest

from pipeline.config import TokenizerConfig, parse_config
from pipeline.reading import Unit, tokenize_unit
from pipeline.sources import plan_pieces
from pipeline.tokenization import (
    BACKEND_FAST,
    BACKEND_HF,
    BACKEND_HF_FALLBACK,
    CL100K_TIKTOKEN_PATTERN,
    FAST_PROBE,
    FastBackendError,
    FastEncoder,
    LoadedTokenizer,
    _cl100k_ranks_file,
    default_tokenizer_file,
    load_tokenizer,
    verify_sample,
)
from tests.conftest import stdlib_texts


def _tiktoken(pattern: str = CL100K_TIKTOKEN_PATTERN):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(_cl100k_ranks_file()))
    return tiktoken.Encoding("t", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def test_default_hf_tokenizer_is_cl100k_exactly(tokenizer):
    """The converted HF tokenizer gives tiktoken's ids, digits included ("0010" -> 001|0)."""
    enc = _tiktoken()
    hf = tokenizer.tokenizer
    assert [hf.id_to_token(i) for i in tokenizer.encode(["0010"])[0]] == ["001", "0"]
    texts = list(FAST_PROBE) + stdlib_texts(60)
    for text in texts:
        assert hf.encode(text, add_special_tokens=False).ids == enc.encode_ordinary(text), text


def test_fast_backend_is_used_and_exact(tokenizer):
    assert tokenizer.fast is not None, "the default tokenizer should get the fast backend"
    texts = stdlib_texts(20) + ["<|endoftext|> literal", "12345678"]
    flat, offsets, backend = tokenizer.encode_verified(texts)
    want_flat, want_offsets = tokenizer.encode(texts)
    assert backend == BACKEND_FAST
    assert flat.tolist() == want_flat.tolist() and offsets.tolist() == want_offsets.tolist()


def test_verify_sample_is_proportional_and_deterministic():
    texts = [("x" * (10 + i % 7 * 300)) for i in range(1000)]
    total = sum(map(len, texts))
    picked = verify_sample(texts, 0.01)
    assert picked == verify_sample(texts, 0.01)
    assert picked[0] == 0 and all(b - a >= 100 for a, b in zip(picked, picked[1:], strict=False))
    assert 0 < sum(len(texts[i]) for i in picked) <= 0.01 * total
    # One huge document among small ones: the budget is never blown, the check never skipped.
    texts = ["y" * 1_000_000] + ["z" * 50] * 10
    assert verify_sample(texts, 0.01) == [1]
    assert verify_sample(["only one"], 0.01) == [0]


def _with_fast(tok: LoadedTokenizer, fast, backend: str) -> LoadedTokenizer:
    from dataclasses import replace

    return replace(tok, fast=fast, backend=backend)


def test_inexact_fast_backend_falls_back_or_fails(tokenizer):
    """A fast encoder that splits digits differently is caught by the sample, not trusted."""
    wrong = FastEncoder(_tiktoken(CL100K_TIKTOKEN_PATTERN.replace(r"\p{N}{1,3}+", r"\p{N}+")))
    texts = [f"version {20261122 + i} of the file" for i in range(300)]
    auto = _with_fast(tokenizer, wrong, "auto")
    flat, offsets, backend = auto.encode_verified(texts)
    assert backend == BACKEND_HF_FALLBACK
    assert flat.tolist() == tokenizer.encode(texts)[0].tolist()
    # Without digits the wrong encoder happens to agree: then it may be used.
    assert auto.encode_verified(["plain words only"])[2] == BACKEND_FAST
    strict = _with_fast(tokenizer, wrong, "tiktoken")
    with pytest.raises(FastBackendError, match="version 2026"):
        strict.encode_verified(texts)


def test_backend_hf_never_uses_the_fast_encoder():
    tok = load_tokenizer(TokenizerConfig(backend="hf"))
    assert tok.fast is None
    assert tok.encode_verified(["some text 123"])[2] == BACKEND_HF


def test_tokenizer_json_gets_a_fast_form_and_a_bad_one_is_refused(tmp_path):
    """A byte-level BPE tokenizer.json is ported generically; the probe rejects a bad port."""
    good = tmp_path / "good.json"
    good.write_text(default_tokenizer_file().read_text())
    tok = load_tokenizer(TokenizerConfig(name=str(good), eos_id=100257))
    assert tok.fast is not None
    assert tok.encode_verified(["x = 1234\n"])[2] == BACKEND_FAST
    # The possessive pattern means something else to Oniguruma than to tiktoken's engine.
    d = json.loads(default_tokenizer_file().read_text())
    d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = CL100K_TIKTOKEN_PATTERN
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    assert load_tokenizer(TokenizerConfig(name=str(bad), eos_id=100257)).fast is None
    with pytest.raises(FastBackendError, match="not exact"):
        load_tokenizer(TokenizerConfig(name=str(bad), eos_id=100257, backend="tiktoken"))


def test_blocks_report_the_backend_and_match_hf(tmp_path):
    texts = stdlib_texts(6)
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = parse_config({"seq_len": 64, "streams": {"s": {"paths": [str(path)]}}})
    unit = Unit(0, tuple(plan_pieces([str(path)], "jsonl", 1 << 20)[0]))
    fast = tokenize_unit(unit, cfg.streams["s"], load_tokenizer(cfg.tokenizer))
    hf_cfg = cfg.tokenizer.model_copy(update={"backend": "hf"})
    slow = tokenize_unit(unit, cfg.streams["s"], load_tokenizer(hf_cfg))
    assert fast.column("backend").to_pylist() == [BACKEND_FAST] * len(texts)
    assert slow.column("backend").to_pylist() == [BACKEND_HF] * len(texts)
    assert fast.column("tokens").equals(slow.column("tokens"))
    # The backend is not part of the run's identity: resume states stay valid across it.
    assert (
        cfg.config_hash()
        == parse_config(
            {
                "seq_len": 64,
                "tokenizer": {"backend": "hf"},
                "streams": {"s": {"paths": [str(path)]}},
            }
        ).config_hash()
    )


def test_fast_backend_on_hostile_texts(tokenizer):
    """Long unbroken runs, mixed scripts, lone surrogate-free oddities: same ids as HF."""
    from dataclasses import replace

    every = replace(tokenizer, verify_fraction=1.0)  # check every text, not a sample
    texts = [
        "a" * 200_000,
        "ab1" * 50_000,
        "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(50_000)),
        " " * 10_000 + "x",
        "\n" * 5_000,
        "\ufeffBOM then text\u2028line sep\u0085nel",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 " * 1000,
    ]
    flat, offsets, backend = every.encode_verified(texts)
    assert backend == BACKEND_FAST
    assert flat.tolist() == tokenizer.encode(texts)[0].tolist()


@pytest.mark.parametrize("variant", ["gpt2_bytelevel", "nfc"])
def test_other_byte_level_forms_get_an_exact_fast_backend(tmp_path, variant):
    """GPT-2-style (ByteLevel's own split) and NFC-normalized (Qwen2-style) tokenizer.json
    files are ported too, and give the HF ids, decomposed accents and digit runs included."""
    d = json.loads(default_tokenizer_file().read_text())
    if variant == "gpt2_bytelevel":
        d["pre_tokenizer"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        }
    else:
        d["normalizer"] = {"type": "NFC"}
    path = tmp_path / f"{variant}.json"
    path.write_text(json.dumps(d))
    tok = load_tokenizer(TokenizerConfig(name=str(path), eos_id=100257))
    assert tok.fast is not None, variant
    texts = ["cafe\u0301 nai\u0308ve 12345 x  \n\n y", *stdlib_texts(5)]
    every = _with_fast(tok, tok.fast, "auto")
    from dataclasses import replace

    every = replace(every, verify_fraction=1.0)
    flat, _, backend = every.encode_verified(texts)
    assert backend == BACKEND_FAST
    assert flat.tolist() == tok.encode(texts)[0].tolist()


@pytest.mark.parametrize("key", ["bos_id", "eos_id", "pad_id"])
def test_special_ids_outside_the_vocabulary_are_refused(key):
    from pipeline.config import TokenizerConfig

    with pytest.raises(ValueError, match=rf"tokenizer.{key}: 2000000000 is not an id of 'default'"):
        load_tokenizer(TokenizerConfig(**{key: 2_000_000_000}))
