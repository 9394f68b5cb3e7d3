"""Object stores through fsspec with per-stream `storage_options` (issue 14, item 1).

A real S3 API (moto's server mode, a subprocess on 127.0.0.1) holds a tiny JSONL + Parquet
corpus. No AWS variable or credentials file is visible to anything here, so the stream's
`storage_options` (endpoint, key, secret) are the only way in: planning (driver), reading
(in-process and in Ray Data workers) and the CLI all use them. The secret never shows up in
output, files, reprs, dumps or errors, and the config hash does not depend on it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.read.resolve import parse_config
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient

SECRET = "s3cr3t-Sh0uld-N0t-Leak-4242"
KEY = "tokenmill-test-key"
BUCKET = "corpus"


def _no_aws_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    nowhere = "/nonexistent/tokenmill-no-aws"
    # No credentials file, no config file, no instance metadata: only storage_options work.
    env |= {"AWS_CONFIG_FILE": nowhere, "AWS_SHARED_CREDENTIALS_FILE": nowhere,
            "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint():
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_no_aws_env(),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + patient(60)
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start (exit {proc.poll()})") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def corpus(endpoint, tmp_path_factory):
    """The same files locally and in s3://corpus/data/."""
    import boto3

    local = tmp_path_factory.mktemp("s3corpus")
    write_jsonl(local / "a.jsonl", stdlib_texts(6, max_bytes=2500))
    write_jsonl(local / "b.jsonl", stdlib_texts(5, start=6, max_bytes=2500))
    texts = stdlib_texts(8, start=20, max_bytes=2500)
    pq.write_table(pa.table({"text": texts}), local / "c.parquet", row_group_size=3)
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY,
                      aws_secret_access_key=SECRET, region_name="us-east-1")  # fmt: skip
    s3.create_bucket(Bucket=BUCKET)
    for f in sorted(local.iterdir()):
        s3.upload_file(str(f), BUCKET, f"data/{f.name}")
    return local


@pytest.fixture
def no_aws(monkeypatch):
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in _no_aws_env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)


def _config(endpoint: str | None, local: Path) -> dict:
    opts = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
    where = f"s3://{BUCKET}/data" if endpoint else str(local)
    remote = {"storage_options": opts} if endpoint else {}
    return {
        "seq_len": 128,
        "global_batch_size": 4,
        "streams": {
            "web": {"paths": [f"{where}/*.jsonl"], "weight": 0.6, **remote},
            "pq": {"paths": [f"{where}/c.parquet"], "weight": 0.4, **remote},
        },
    }


def _steps(out: Path) -> list[tuple[str, pa.Table, dict]]:
    """Each step file's table and its metadata less `config_hash` (which hashes the paths,
    `s3://…` here and `/tmp/…` there: the only byte that may differ)."""
    steps = []
    for f in sorted(out.glob("step-*.parquet")):
        t = pq.read_table(f)
        meta = {k: v for k, v in t.schema.metadata.items() if k != b"config_hash"}
        steps.append((f.name, t.replace_schema_metadata(None), meta))
    return steps


def _assert_same_steps(a: Path, b: Path) -> None:
    sa, sb = _steps(a), _steps(b)
    assert len(sa) >= 3 and [s[0] for s in sa] == [s[0] for s in sb]
    for (name, ta, ma), (_, tb, mb) in zip(sa, sb, strict=True):
        assert ta.equals(tb), name
        assert ma == mb, name


def _secret_in(directory: Path) -> list[str]:
    return [
        str(f) for f in directory.rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()
    ]


def test_cli_export_from_s3_equals_the_local_export(endpoint, corpus, tmp_path):
    for name, cfg in (("s3", _config(endpoint, corpus)), ("local", _config(None, corpus))):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    runs = {}
    for name in ("s3", "local"):
        runs[name] = subprocess.run(
            [sys.executable, "-m", "service", "export", "--config", f"{name}.yaml",
             "--out", name, "--local"],
            capture_output=True, text=True, timeout=patient(300), cwd=tmp_path, env=_no_aws_env(),
        )  # fmt: skip
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    _assert_same_steps(tmp_path / "local", tmp_path / "s3")
    check = subprocess.run(
        [sys.executable, "-m", "service", "check", "--config", "s3.yaml"],
        capture_output=True, text=True, timeout=patient(300), cwd=tmp_path, env=_no_aws_env(),
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    for r in (runs["s3"], check):
        assert SECRET not in r.stdout + r.stderr
    assert _secret_in(tmp_path / "s3") == []


def test_ray_workers_read_s3_with_the_streams_options(endpoint, corpus, no_aws, ray_cluster):
    """Every unit read through Ray Data (no head start): the options travel with the tasks."""
    from pipeline.read.reading import iter_blocks_local, iter_blocks_ray
    from pipeline.stages.documents import DocSource

    remote = parse_config(_config(endpoint, corpus))
    local = parse_config(_config(None, corpus))
    assert remote.streams["web"].paths == [
        f"s3://{BUCKET}/data/a.jsonl",
        f"s3://{BUCKET}/data/b.jsonl",
    ]
    for name in ("web", "pq"):
        units = DocSource(name, 0, remote, iter_blocks_local).units(0)
        assert len(units) >= 1
        got = pa.concat_tables(iter_blocks_ray(units, remote.streams[name], remote.tokenizer))
        want_units = DocSource(name, 0, local, iter_blocks_local).units(0)
        want = pa.concat_tables(iter_blocks_local(want_units, local.streams[name], local.tokenizer))
        assert got.column("error").null_count == got.num_rows
        assert got.select(["doc_id", "tokens"]).equals(want.select(["doc_id", "tokens"]))


def test_storage_options_are_secret_everywhere(tmp_path):
    """Keys kept, values "***": repr, dumps, the hash, validation errors."""
    data = str(write_jsonl(tmp_path / "a.jsonl", ["one", "two"]))

    def config(**opts):
        stream = {"paths": [data]} | ({"storage_options": opts} if opts else {})
        return parse_config({"streams": {"s": stream}})

    cfg = config(key=KEY, secret=SECRET)
    stream = cfg.streams["s"]
    assert stream.storage_options["secret"] == SECRET  # the readers get the real value
    for shown in (repr(cfg), str(cfg), repr(stream), cfg.model_dump_json(),
                  str(cfg.model_dump()), str(cfg.model_dump(mode="json"))):  # fmt: skip
        assert SECRET not in shown and KEY not in shown
    assert cfg.model_dump()["streams"]["s"]["storage_options"] == {"key": "***", "secret": "***"}
    assert cfg.config_hash() == config(anon=True).config_hash() == config().config_hash()
    with pytest.raises(ConfigError) as e:
        parse_config({"streams": {"s": {"paths": [data], "storage_options": SECRET}}})
    assert "storage_options" in str(e.value) and SECRET not in str(e.value)
