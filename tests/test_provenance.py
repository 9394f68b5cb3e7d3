"""Provenance: `tokenmill trace` and `GET /v1/steps/{n}/provenance` name, for every segment of
a step, the file, record and token range it came from. Checked against the files themselves,
and the same from an export's directory (world size 1 or 2), from a state, and from a running
server, for a step it holds and for one it has released."""

import json
import subprocess
import sys
import time

import pytest
import yaml
from fastapi.testclient import TestClient

from pipeline.inspect.provenance import documents_of, trace
from pipeline.read.reading import iter_blocks_local
from pipeline.read.resolve import load_config
from service.api import Backend, create_app
from service.batch_server import BatchServer
from service.export import run_export
from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient

TOKEN = "pr0v-token"
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-stream config, exported at world size 1 and 2 with states every 4 steps."""
    d = tmp_path_factory.mktemp("prov")
    write_jsonl(d / "a.jsonl", stdlib_texts(16, max_bytes=2500))
    write_jsonl(d / "b.jsonl", stdlib_texts(16, start=30, max_bytes=2500))
    (d / "c.yaml").write_text(yaml.safe_dump({
        "seed": 11, "seq_len": 96, "global_batch_size": 4, "shuffle": {"window": 4},
        "tokenizer": {"name": "default", "add_eos": True},
        "streams": {"web": {"paths": [str(d / "a.jsonl")], "weight": 0.6},
                    "code": {"paths": [str(d / "b.jsonl")], "weight": 0.4}}}))  # fmt: skip
    cfg = load_config(d / "c.yaml")
    for world in (1, 2):
        run_export(cfg, d / f"w{world}", steps=12, world_size=world, executor=iter_blocks_local,
                   state_every=4)  # fmt: skip
    return {"dir": d, "cfg": cfg}


def record_text(source: str, record: int) -> str:
    with open(source) as f:
        for i, line in enumerate(f):
            if i == record:
                return json.loads(line)["text"]
    raise AssertionError(f"{source} has no record {record}")


def test_every_segment_names_the_record_it_came_from(run):
    segs = trace(run["cfg"], range(12), out=run["dir"] / "w1", text=True)
    assert {s["stream"] for s in segs} == {"web", "code"}
    for s in segs:
        text = s["text"].replace(EOT, "")
        assert text in record_text(s["source"], s["record"]), s
        a, b = s["tokens"]
        assert b - a == s["row_span"][1] - s["row_span"][0] > 0
    split = [s for s in segs if s["tokens"][0] > 0]
    assert split, "a document split across rows shows its later pieces' offsets"
    assert len(documents_of(segs)) < len(segs)


def test_the_same_from_world_sizes_a_state_and_the_cli(run):
    cfg, d = run["cfg"], run["dir"]
    want = trace(cfg, [9], out=d / "w1")
    two = trace(cfg, [9], out=d / "w2")
    assert [{**s, "rank": 0} for s in two] == want
    assert {s["rank"] for s in two} == {0, 1}
    assert trace(cfg, [9], out=d / "w2", rank=1) == [s for s in two if s["rank"] == 1]
    state = json.loads((d / "w1" / "state-00000008.json").read_text())
    assert trace(cfg, [9], state=state) == want  # rebuilt at step 8, run forward one step
    # A range from a state: rebuilt once, run forward once past every step asked for.
    assert trace(cfg, [11, 9, 10], state=state) == trace(cfg, [9, 10, 11], out=d / "w1")
    with pytest.raises(ValueError, match="cannot give the earlier step"):
        trace(cfg, [3], state=state)
    cli = subprocess.run(
        [sys.executable, "-m", "service", "trace", "--config", str(d / "c.yaml"), "--out",
         str(d / "w2"), "--step", "9", "--json"], capture_output=True, text=True, timeout=patient(120),
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == two
    missing = subprocess.run(
        [sys.executable, "-m", "service", "trace", "--config", str(d / "c.yaml"), "--out",
         str(d / "w2"), "--step", "40"], capture_output=True, text=True, timeout=patient(120),
    )  # fmt: skip
    assert missing.returncode == 1 and "no files of step 40" in missing.stderr
    for rank, world, says in (("7", [], "outside world size 2"), ("-1", [], "--rank must be >= 0"),
                              ("2", ["--world-size", "2"], "outside --world-size 2")):  # fmt: skip
        outside = subprocess.run(
            [sys.executable, "-m", "service", "trace", "--config", str(d / "c.yaml"), "--out",
             str(d / "w2"), "--step", "9", "--rank", rank, *world], capture_output=True,
            text=True, timeout=patient(120),
        )  # fmt: skip
        assert outside.returncode == 2 and says in outside.stderr, (rank, outside.stderr)


@pytest.mark.slow
def test_a_running_server_answers_for_held_and_released_steps(run, ray_cluster, monkeypatch):
    cfg, d = run["cfg"], run["dir"]
    srv = BatchServer(cfg.model_dump(mode="json"), prefetch=3)
    try:
        for step in range(6):  # one rank of one takes steps 0..5: 0..2 are released
            deadline = time.time() + patient(60)
            while not srv.get(0, 1, step, 1.0).ready:
                assert time.time() < deadline
        assert 0 not in srv.window.steps and 6 in srv.window.steps or srv.window.produced <= 6
        for step in (1, 6):  # recomputed from a kept state; held
            assert srv.provenance(step, 2) == trace(cfg, [step], out=d / "w2")
        monkeypatch.setenv("TOKENMILL_API_TOKEN", TOKEN)
        client = TestClient(create_app(Backend(srv)))
        url = "/v1/steps/1/provenance?rank=1&world_size=2"
        assert client.get(url).status_code == 401  # it reveals data: the token is needed
        got = client.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert got.status_code == 200
        assert got.json() == trace(cfg, [1], out=d / "w2", rank=1)
        late = client.get("/v1/steps/999/provenance", headers={"Authorization": f"Bearer {TOKEN}"})
        assert late.status_code == 404 and "not been produced" in late.json()["detail"]
        # A rank the world does not have: a 400 naming it, never an empty 200 (the world
        # served is 1 rank here).
        for url, world in (("/v1/steps/5/provenance?rank=5&world_size=1", 1),
                           ("/v1/steps/5/provenance?rank=2&world_size=2", 2),
                           ("/v1/steps/5/provenance?rank=1", 1)):  # fmt: skip
            outside = client.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
            assert outside.status_code == 400, (url, outside.text)
            assert f"outside world size {world}" in outside.json()["detail"]
    finally:
        srv.close()
