"""The tokenizer is trusted only where that is earned (issue 24): the fast split proven per
code point (U+180E), pathological records counted as rejects, the tokenizer's content part of
its identity (pool cache, config hash)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import TokenizerConfig
from pipeline.read.reading import iter_blocks_local, tokenize_unit_json
from pipeline.read.resolve import parse_config
from pipeline.stages.documents import BadRecordError
from pipeline.state.resume import StateError, check_state
from pipeline.tokenize.encoders import CL100K_TIKTOKEN_PATTERN, FAST_PROBE
from pipeline.tokenize.engines import BACKEND_HF_SPLIT, load_tokenizer
from pipeline.tokenize.files import CL100K_HF_PATTERN
from pipeline.tokenize.proofs import class_atoms, split_exceptions
from service.export import run_export
from tests.conftest import stdlib_texts, write_jsonl

CL100K = (CL100K_TIKTOKEN_PATTERN, CL100K_HF_PATTERN)
WHITESPACE = (
    "\t\n\x0b\x0c\r \x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000\u200b\u200c\u200d\u2060\ufeff"
)
CONTEXTS = ("{c}", " {c}", "  {c}", "a{c}b", "1{c}2", "{c}\n", "\n{c} x", "x {c}{c} y",
            "'{c}s", "!{c}?", "\u180e{c}", "{c} ", "\t{c}\t", "你{c}好")  # fmt: skip


# --- Finding 2: the fast split, proven per code point ---


def test_the_fast_probe_holds_u180e_and_the_whitespace_family():
    probe = "".join(FAST_PROBE)
    assert "\u180e" in probe
    assert all(c in probe for c in WHITESPACE if c not in "\u200c\u200d\u2060")


def test_the_classes_of_cl100k_are_taken_apart():
    atoms = class_atoms(*CL100K)
    assert atoms is not None
    assert {r"\p{L}", r"\p{N}", r"\s", r"\S", r"[^\s\p{L}\p{N}]", r"[^\r\n\p{L}\p{N}]"} <= set(
        atoms
    )
    assert "(?i:[delmrstv])" in atoms  # the case-insensitive contractions
    assert class_atoms("(?i)abc") is None  # a flag it cannot follow: not checked


def test_split_exceptions_are_found_over_every_code_point(tokenizer):
    """fastokens (PCRE2) and HF (Oniguruma) disagree on U+180E only; tiktoken on none. The
    default tokenizer's guard holds it, and says so."""
    assert split_exceptions(CL100K, "fastokens") == (0x180E,)
    assert split_exceptions(CL100K, "tiktoken") == ()
    assert tokenizer.fast.name == "fastokens"
    assert tokenizer.split_guard is not None and tokenizer.split_guard.code_points == (0x180E,)
    assert tokenizer.guarantees.split_classes == "proven; to hf: U+180E"
    tiktoken = load_tokenizer(TokenizerConfig(backend="tiktoken"))
    assert tiktoken.split_guard is None and tiktoken.guarantees.split_classes == "proven"


@pytest.mark.parametrize("char", ["\u180e", *WHITESPACE])
def test_whitespace_and_u180e_get_the_hf_ids_in_many_contexts(tokenizer, char):
    texts = [c.format(c=char) for c in CONTEXTS]
    texts += [" ".join(texts), "x" * 300 + texts[2]]
    for text in texts:
        flat, _, backend = tokenizer.encode_verified([text])
        want = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        assert flat.tolist() == want, (text, backend)
        assert (backend == BACKEND_HF_SPLIT) == ("\u180e" in text)


def _u180e_corpus(src: Path) -> Path:
    texts = [t[k : k + 350] for t in stdlib_texts(150, max_bytes=1400) for k in (0, 350, 700, 1050)]
    texts = [t for t in texts if t.strip()][:300]
    for i in (7, 150, 299):
        texts[i] = texts[i][:200] + "  \u180e mongolian\u180eseparator \u180e\n" + texts[i][200:]
    return write_jsonl(src / "u.jsonl", texts)


def test_an_export_with_u180e_equals_the_hf_export(tmp_path):
    """300 documents, 3 with U+180E: the same bytes as `tokenizer.backend: hf`, and the
    documents that went to HF for it are counted (`hf_split`)."""
    path = _u180e_corpus(tmp_path)
    outs = {}
    for backend in ("auto", "hf"):
        cfg = parse_config({
            "seq_len": 256, "global_batch_size": 4, "packing": {"mode": "bfd"},
            "tokenizer": {"backend": backend}, "streams": {"u": {"paths": [str(path)]}},
        })  # fmt: skip
        outs[backend] = run_export(cfg, tmp_path / backend, executor=iter_blocks_local)
    files = sorted(p.name for p in (tmp_path / "hf").glob("step-*"))
    assert files
    for name in files:
        assert (tmp_path / "auto" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    used = outs["auto"].tokenizer_backend
    assert used["hf_split"] > 0 and used["fastokens"] > 0
    summary = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert summary["tokenizer_backend"]["hf_split"] == used["hf_split"]


# --- Finding 3: pathological records are counted rejects ---

HUGE = " " * 10_000_000 + "a"  # PCRE2: match limit exceeded; Oniguruma: a Rust panic


def _hostile_corpus(src: Path) -> tuple[Path, list[str]]:
    good = stdlib_texts(6, max_bytes=3000)
    return write_jsonl(src / "h.jsonl", [good[0], HUGE, *good[1:]]), good


def _hostile_config(path: Path, backend: str, on_error: str, kind: str = "pretrain"):
    return parse_config({
        "seq_len": 128, "global_batch_size": 2, "packing": {"mode": "bfd"}, "on_error": on_error,
        "tokenizer": {"backend": backend},
        "streams": {"h": {"paths": [str(path)], "kind": kind, **(
            {"messages_field": "messages"} if kind == "chat" else {})}},
    })  # fmt: skip


@pytest.mark.parametrize("backend", ["auto", "hf"])
def test_a_record_the_tokenizer_fails_on_is_a_counted_reject(tmp_path, backend):
    path, good = _hostile_corpus(tmp_path)
    cfg = _hostile_config(path, backend, "skip")
    s = run_export(cfg, tmp_path / "o", executor=iter_blocks_local)
    assert s.streams["h"].skipped == 1 and s.streams["h"].docs == len(good)
    [reject] = [json.loads(line) for line in (tmp_path / "o" / "rejects.jsonl").open()]
    assert reject["record"] == 1 and reject["file"] == str(path)
    assert "the tokenizer failed on this record" in reject["reason"]
    want = sum(len(load_tokenizer(cfg.tokenizer).encode([t])[0]) + 1 for t in good)
    assert s.streams["h"].tokens == want  # every good document, whole


def test_a_record_the_tokenizer_fails_on_names_file_and_record_under_fail(tmp_path):
    path, _ = _hostile_corpus(tmp_path)
    with pytest.raises(BadRecordError, match=f"{path}, record 1: the tokenizer failed"):
        run_export(_hostile_config(path, "auto", "fail"), tmp_path / "o",
                   executor=iter_blocks_local)  # fmt: skip


def test_a_conversation_the_tokenizer_fails_on_is_a_counted_reject(tmp_path):
    convs = [
        [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"ok {i}"}]
        for i in range(4)
    ]
    convs[2][0]["content"] = HUGE
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    cfg = _hostile_config(path, "hf", "skip", kind="chat")
    s = run_export(cfg, tmp_path / "o", executor=iter_blocks_local)
    assert s.streams["h"].skipped == 1 and s.streams["h"].docs == 3
    [reject] = [json.loads(line) for line in (tmp_path / "o" / "rejects.jsonl").open()]
    assert reject["record"] == 2 and "PanicException" in reject["reason"]


# --- Finding 5: the tokenizer's content is its identity ---


def _word_tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def test_a_tokenizer_rewritten_under_the_same_path_is_loaded_afresh(tmp_path):
    """A warm worker (a pool actor) keys its tokenizer by content, not by path."""
    path = _word_tokenizer(tmp_path / "tokenizer.json", ["hello", "world"])
    unit = json.dumps({"index": 0, "pieces": []})
    cfg = TokenizerConfig(name=str(path), eos_id=0, backend="hf")
    assert load_tokenizer(cfg).encode(["hello world"])[0].tolist() == [1, 2]
    tokenize_unit_json(unit, {"paths": ["x"], "format": "jsonl"}, cfg.model_dump(mode="json"))
    _word_tokenizer(path, ["world", "hello"])
    assert load_tokenizer(cfg).encode(["hello world"])[0].tolist() == [2, 1]


def test_the_config_hash_covers_the_tokenizer_content(tmp_path):
    """A state written with the old file is refused at a resume under the new one."""
    path = _word_tokenizer(tmp_path / "tokenizer.json", ["hello", "world"])
    data = write_jsonl(tmp_path / "d.jsonl", ["hello world"] * 50)
    raw = {"seq_len": 8, "global_batch_size": 2, "tokenizer": {"name": str(path), "eos_id": 0},
           "streams": {"d": {"paths": [str(data)]}}}  # fmt: skip
    cfg = parse_config(raw)
    run_export(cfg, tmp_path / "o", steps=2, state_every=1, executor=iter_blocks_local)
    state = json.loads((tmp_path / "o" / "state-00000001.json").read_text())
    old = cfg.config_hash()
    check_state(state, parse_config(raw).config_hash(), ["d"], False)  # same file: accepted
    _word_tokenizer(path, ["world", "hello"])
    changed = parse_config(raw).config_hash()
    assert changed != old
    with pytest.raises(StateError, match="written by config"):
        check_state(state, changed, ["d"], False)
    with pytest.raises(StateError, match="written by config"):
        run_export(parse_config(raw), tmp_path / "again", resume=state,
                   executor=iter_blocks_local)  # fmt: skip


def test_the_default_tokenizer_keeps_its_config_hash():
    cfg = parse_config({"streams": {"a": {"paths": [__file__], "format": "text"}}})
    assert "content_sha256" not in json.dumps(cfg.model_dump(mode="json"))
    assert (
        cfg.config_hash()
        == parse_config({"streams": {"a": {"paths": [__file__], "format": "text"}}}).config_hash()
    )
