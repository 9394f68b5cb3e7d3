"""`tokenmill stop` drains a live run on `serve`'s own Ray: no step is made after it, every
rank gets every step made before it and then a clean end (StopIteration, its final state
kept), and `serve` keeps its Ray up until the ranks' processes have left it. Before, `serve`
exited at once and took its Ray with it: 62 s later the ranks died failing to reach it.
The ranks are launched together with `serve` and wait for it to start."""

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import fresh_cache, stdlib_texts, write_jsonl
from tests.rayhead import free_port, patient

pytestmark = pytest.mark.slow

# A rank of two, found by the service's record: it trains slowly, ends cleanly, keeps its
# final state, then "writes its checkpoint" for a few seconds, needing its Ray no more.
RANK = r"""
import json, sys, time
from trainer.feed import Feed
name, rank, out, step_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
feed = Feed.connect(service=name, rank=rank, world_size=2, timeout_s=120)
steps = []
for batch in feed:
    steps.append(batch["global_step"])
    if len(steps) == 3:
        open(out + ".started", "w").close()
    time.sleep(step_s)
final = feed.state_dict()["step"]
time.sleep(4)  # its final checkpoint, after the end
json.dump({"steps": steps, "final": final, "exited": time.time()}, open(out, "w"))
"""


@pytest.mark.parametrize("now", [False, True], ids=["drain", "now"])
def test_stop_drains_and_never_kills_the_trainers(tmp_path, now):
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(80, max_bytes=3000))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                                   "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}}}))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TOKENMILL_RAY_ADDRESS")}
    env |= {"TOKENMILL_CACHE": str(fresh_cache(tmp_path / "cache"))}
    name, port = f"stop{os.getpid()}{int(now)}", free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        serve = subprocess.Popen([sys.executable, "-m", "service", "serve", "--config", str(cfg),
                                  "--port", str(port), "--name", name], env=env, stdout=out,
                                 stderr=subprocess.STDOUT, cwd=tmp_path)  # fmt: skip
    ranks = []
    try:
        # Trainers launched together with serve: once it has claimed its record (at once,
        # before its Ray starts), they wait for it to come up instead of failing.
        record = tmp_path / "cache" / "services" / f"{name}.json"
        deadline = time.time() + patient(60)
        while not record.exists():
            assert time.time() < deadline and serve.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        # `status` launched with serve waits for it too (its record is claimed); its Ray can
        # take over the default 30 s on a busy machine, so the wait here is longer.
        if not now:
            st = subprocess.run([sys.executable, "-m", "service", "status", "--name", name,
                                 "--wait", "150"],
                                env=env, capture_output=True, text=True, timeout=patient(180))  # fmt: skip
            assert st.returncode == 0 and f"service   {name}" in st.stdout, st.stdout + st.stderr
        outs = [tmp_path / f"rank{r}.json" for r in range(2)]
        ranks = [subprocess.Popen([sys.executable, "-c", RANK, name, str(r), str(outs[r]), "0.3"],
                                  env=env, stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
        deadline = time.time() + patient(180)
        while not all(o.with_suffix(".json.started").exists() for o in outs):
            assert time.time() < deadline and all(p.poll() is None for p in ranks), "ranks stuck"
            time.sleep(0.1)
        stop = subprocess.run([sys.executable, "-m", "service", "stop", "--name", name,
                               *(["--now"] if now else [])], env=env, capture_output=True,
                              text=True, timeout=patient(300))  # fmt: skip
        assert stop.returncode == 0 and f"stopped {name!r}" in stop.stdout, (
            stop.stdout + stop.stderr
        )
        for p in ranks:
            _, err = p.communicate(timeout=patient(120))
            assert p.returncode == 0, err[-3000:]  # a clean end, and its Ray stayed up
        assert serve.wait(timeout=patient(60)) == 0, log.read_text()[-3000:]
        served_out = time.time()
        got = [json.loads(o.read_text()) for o in outs]
        text = log.read_text()
        assert "stopped by request: every rank has taken its last step" in text, text[-2000:]
        for g in got:
            assert g["steps"] == list(range(len(g["steps"]))) and g["final"] == len(g["steps"])
            assert g["exited"] <= served_out  # serve left its Ray up until the rank had gone
        if not now:  # every step made before the stop went to every rank, then the end
            assert len({len(g["steps"]) for g in got}) == 1
            assert len(got[0]["steps"]) >= 8, got[0]["steps"]
    finally:
        for p in (*ranks, serve):
            if p.poll() is None:
                p.kill()
                p.wait()
