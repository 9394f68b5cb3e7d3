"""The service end to end: `python -m service serve` on a running cluster, two consumer
processes pulling disjoint batches through trainer.feed.Feed, and failing fast when it dies."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import patient, serve_process, wait_http

pytestmark = pytest.mark.slow

CONSUMER = r"""
import json, sys, time
from trainer.feed import Feed
address, name, rank, world, n, out = sys.argv[1:7]
feed = Feed.connect(service=name, rank=int(rank), world_size=int(world), address=address)
got = []
for i, batch in zip(range(int(n)), feed):
    got.append({"step": batch["global_step"], "rows": batch["input_ids"].shape[0],
                "L": batch["input_ids"].shape[1], "dtype": str(batch["input_ids"].dtype),
                "first_ids": batch["input_ids"][:, :8].tolist()})
    feed.report_wait(0.001)
state = feed.state_dict()
json.dump({"got": got, "state_step": state["step"]}, open(out, "w"))
"""


@pytest.fixture
def service(ray_cluster, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(30, max_bytes=4000))
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write('{"text": "cut short\n{"text": 7}\n')  # two bad records: lines 30 and 31
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                                   "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}}))  # fmt: skip
    address = ray_cluster.get_runtime_context().gcs_address
    env = os.environ | {"TOKENMILL_API_TOKEN": "t0ken"}
    with serve_process(cfg, address, f"svc{os.getpid()}", tmp_path, env) as svc:
        yield svc


def test_two_consumer_processes_get_disjoint_rows_of_one_sequence(service, tmp_path):
    outs = [tmp_path / f"r{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", CONSUMER, service["address"], service["name"], str(r), "2", "5", str(outs[r])])
        for r in range(2)
    ]  # fmt: skip
    for p in procs:
        assert p.wait(timeout=patient(180)) == 0
    r0, r1 = (json.loads(o.read_text()) for o in outs)
    assert [g["step"] for g in r0["got"]] == [g["step"] for g in r1["got"]] == [0, 1, 2, 3, 4]
    for a, b in zip(r0["got"], r1["got"], strict=True):
        assert a["rows"] == b["rows"] == 2 and a["L"] == 64 and a["dtype"] == "torch.int64"
        assert a["first_ids"] != b["first_ids"], "ranks must get different rows"
    assert r0["state_step"] == r1["state_step"] == 5
    st = wait_http(f"http://127.0.0.1:{service['port']}/v1/status")
    assert st["world_size"] == 2 and st["global_step"] >= 5
    m = wait_http(f"http://127.0.0.1:{service['port']}/v1/metrics")
    assert m["data_wait_reports"] >= 10
    assert m["ranks"]["0"]["waits"] >= 5 and m["ranks"]["1"]["lag"] >= 0


def test_serve_writes_skipped_records_to_the_rejects_file(service, ray_cluster, tmp_path):
    """`service.rejects` (default rejects.jsonl, in serve's working directory)."""
    from trainer.feed import Feed

    feed = Feed.connect(service=service["name"], rank=0, world_size=1, timeout_s=30)
    deadline = time.time() + patient(120)
    path = tmp_path / "rejects.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= 2):
        assert time.time() < deadline, "no rejects file"
        next(feed, None)  # read on, to the bad lines at the end of the file
    rejects = [json.loads(x) for x in path.read_text().splitlines()]
    assert sorted(r["record"] for r in rejects) == [30, 31]
    assert all(r["file"].endswith("a.jsonl") and r["reason"] for r in rejects)
    m = wait_http(f"http://127.0.0.1:{service['port']}/v1/metrics")
    assert m["rejects"] == 2 and m["streams"]["a"]["skipped"] == 2


def test_client_fails_fast_when_the_service_dies(service, ray_cluster):
    from trainer.feed import Feed, FeedError

    feed = Feed.connect(service=service["name"], rank=0, world_size=1, timeout_s=20)
    assert next(feed)["input_ids"].shape == (4, 64)
    # The first SIGTERM drains (the rank would get its end); a second stops at once, and
    # serve kills its actor on the way out.
    service["proc"].send_signal(signal.SIGTERM)
    time.sleep(2)
    service["proc"].send_signal(signal.SIGTERM)
    assert service["proc"].wait(timeout=30) == 0
    t = time.time()
    with pytest.raises(FeedError):
        for _ in range(100):
            next(feed)
    assert time.time() - t < 10
