"""End to end against the script a user would write instead (issue 15), cold and warm.

    tokenmill bench e2e [--corpus FILE.jsonl ...] [--repeats 3] [--json OUT]
    tokenmill bench e2e --hf --corpus FILE.jsonl ... [--cpus N]

Four ways to the same tokens, each a fresh process timed from its start to its exit, in
round-robin order so a shared machine's drift falls on all alike, each started once the
machine is idle (`wait_until_idle`: the leftovers of the method before, such as a cold
export's Ray agents, which linger ~75 s, slowed the next method by up to 25%):

- **script**: `bench/script_peer.py`: `multiprocessing.Pool(N)` + tiktoken cl100k + numpy
  concat + one Parquet file of rows (no shuffle, labels, resume or error handling);
- **tokenmill cold**: `tokenmill export` with nothing running: it starts its own Ray;
- **tokenmill warm**: `tokenmill export --address` to a Ray cluster started once for the
  bench (`ray start --head`, its own temp dir and ports; stopped by its process group).
- **tokenmill pool**: the same with `--pool N`: a warm pool of N tokenizer actors that the
  previous export left (pipeline/read/pool.py), instead of Ray Data tasks in fresh workers. This
  is what `--address` does by default; the warm method above passes `--pool 0`.

Same corpus, L = 2048, concat packing, EOS after each document, N = the machine's CPUs (Ray's
workers get N CPUs too). The figure is wall time; tokenmill's own `summary.json` adds its time
to first step and its steady rate. Ratios are the script's wall / tokenmill's (≥ 1: faster).
The corpus defaults to the demo corpus's Python sources copied to ~100 MB of JSONL.

With `--hf`: `backend: hf` against its limit, on Ray Data tasks and on a warm pool. The limit
is `--cpus` × the single-process rate of the same code path (read + HF tokenize + Arrow,
`reading.iter_blocks_local`) on the corpus's first units, measured in this run. Then, against
one private `ray start --head`: three exports with `--pool N` (the first creates the pool) and
one on Ray Data tasks, each a fresh `tokenmill export` process; the figure is each export's
`steady_tokens_per_s` (summary.json) over the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ_LEN = 2048
TARGET_BYTES = 100 << 20
SCRIPT = Path(__file__).with_name("script_peer.py")
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_corpus(work: Path, target_bytes: int = TARGET_BYTES) -> list[Path]:
    """The demo corpus's code.jsonl, copied into 8 files until they hold ~`target_bytes`."""
    from service.demo_corpus import build_demo_corpus

    code = (build_demo_corpus() / "code.jsonl").read_bytes()
    copies = max(1, round(target_bytes / len(code)))
    files = [work / f"corpus-{i}.jsonl" for i in range(8)]
    for i, f in enumerate(files):
        f.write_bytes(code * len(range(i, copies, 8)))
    return [f for f in files if f.stat().st_size]


class RayHead:
    """A private `ray start --head` for the warm runs: own temp dir and ports, N CPUs."""

    def __init__(self, cpus: int):
        self.temp = tempfile.mkdtemp(prefix="tmb", dir="/tmp")  # AF_UNIX paths stay short
        port = _free_port()
        ports = [f"--{k}={_free_port()}" for k in ("ray-client-server-port",
                 "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                 "metrics-export-port", "runtime-env-agent-port")]  # fmt: skip
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}",
             f"--num-cpus={cpus}", "--include-dashboard=false", f"--temp-dir={self.temp}",
             "--disable-usage-stats", *ports],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.address = f"127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            self.close()
            raise TimeoutError("ray start --head did not come up in 120 s")
        time.sleep(2)  # the raylet registers after the GCS listens

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.temp, ignore_errors=True)


def _busy_jiffies() -> tuple[int, int]:
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return sum(v) - v[3] - v[4], sum(v)  # idle and iowait are not busy


def wait_until_idle(busy_below: float = 0.1, window_s: float = 1.0, max_s: float = 90.0) -> float:
    """Wait until the machine was less than `busy_below` busy over `window_s` (at most `max_s`);
    the seconds waited. A method's leftovers (a cold export's Ray agents linger ~75 s, a
    finished job's workers exit) would otherwise slow whichever method runs next."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_s:
        b0, a0 = _busy_jiffies()
        time.sleep(window_s)
        b1, a1 = _busy_jiffies()
        if (b1 - b0) / max(1, a1 - a0) < busy_below:
            break
    return time.monotonic() - t0


def _timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if p.returncode:
        raise RuntimeError(f"{cmd[0]} ... exited {p.returncode}: {p.stderr[-2000:]}")
    return wall, p.stdout


def run_script(files: list[Path], out: Path, cpus: int) -> dict:
    wall, stdout = _timed([sys.executable, str(SCRIPT), str(out), *map(str, files),
                           "--procs", str(cpus), "--seq-len", str(SEQ_LEN)])  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": wall, "tokens": json.loads(stdout.strip().splitlines()[-1])["tokens"]}


def run_tokenmill(config: Path, out: Path, address: str | None, pool: int = 0) -> dict:
    cmd = [str(BIN / "tokenmill"), "export", "--config", str(config), "--out", str(out)]
    cmd += ["--address", address] if address else []
    cmd += ["--pool", str(pool)] if address else []  # 0: Ray Data (the default is the pool)
    env = dict(os.environ, TOKENMILL_RAY_ADDRESS="", RAY_ADDRESS="")
    wall, _ = _timed(cmd, env)
    s = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    keys = ("wall_s", "startup_s", "time_to_first_step_s", "tokens_per_s", "steady_tokens_per_s")
    return {"wall_s": wall, "tokens": s["real_tokens"], "summary": {k: s[k] for k in keys}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tokenmill bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--corpus", nargs="*", default=None,
                    help="JSONL files with a `text` field (default: the demo code, ~100 MB)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="runs of each method (default 3)")
    ap.add_argument("--cpus", type=int, default=os.cpu_count(), help="default: all cores")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--hf", action="store_true",
                    help="backend: hf against its limit instead (needs --corpus; see above)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.hf:
        if not args.corpus:
            ap.error("--hf needs --corpus FILE.jsonl ...")
        return run_hf(args.corpus, args.cpus)
    result = run(args.corpus, args.repeats, args.cpus)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def run(corpus: list[str] | None, repeats: int, cpus: int, target_bytes: int = TARGET_BYTES):
    """The three methods, `repeats` times each in round-robin order; the summarized result."""
    work = Path(tempfile.mkdtemp(prefix="tokenmill-e2e-"))
    head = None
    try:
        files = [Path(f) for f in corpus] if corpus else default_corpus(work, target_bytes)
        size = sum(f.stat().st_size for f in files)
        config = work / "e2e.yaml"
        config.write_text(json.dumps({
            "seq_len": SEQ_LEN, "global_batch_size": 16, "packing": {"mode": "concat"},
            "streams": {"corpus": {"paths": [str(f.resolve()) for f in files]}},
        }))  # fmt: skip
        print(f"e2e corpus: {len(files)} files, {size / 1e6:.1f} MB; {cpus} CPUs", flush=True)
        head = RayHead(cpus)
        methods = {
            "script": lambda i: run_script(files, work / f"s{i}", cpus),
            "tokenmill_cold": lambda i: run_tokenmill(config, work / f"c{i}", None),
            "tokenmill_warm": lambda i: run_tokenmill(config, work / f"w{i}", head.address),
            "tokenmill_pool": lambda i: run_tokenmill(config, work / f"p{i}", head.address, cpus),
        }
        runs: dict[str, list[dict]] = {k: [] for k in methods}
        run_tokenmill(config, work / "w-first", head.address)  # the cluster's first job: unmeasured
        run_tokenmill(config, work / "p-first", head.address, cpus)  # creates the pool: unmeasured
        for i in range(repeats):
            for name, fn in methods.items():
                waited = wait_until_idle()
                runs[name].append(fn(i) | {"waited_for_idle_s": waited})
                r = runs[name][-1]
                print(f"  {i + 1}/{repeats} {name:<15} {r['wall_s']:6.2f}s  "
                      f"{r['tokens']:,} tokens  (after {waited:.1f}s for an idle machine)",
                      flush=True)  # fmt: skip
    finally:
        if head is not None:
            head.close()
        shutil.rmtree(work, ignore_errors=True)
    return summarize(runs, size, cpus)


def summarize(runs: dict[str, list[dict]], corpus_bytes: int, cpus: int) -> dict:
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    out = {"corpus_bytes": corpus_bytes, "cpus": cpus, "seq_len": SEQ_LEN, "methods": {}}
    for name, v in runs.items():
        walls = [r["wall_s"] for r in v]
        m = {
            "wall_s": walls,
            "wall_median_s": med[name],
            "tokens": v[0]["tokens"],
            "tokens_per_s": v[0]["tokens"] / med[name],
            "speed_over_script": med["script"] / med[name],
        }
        if "summary" in v[0]:
            for k in ("time_to_first_step_s", "steady_tokens_per_s", "startup_s"):
                m[k] = statistics.median(r["summary"][k] or 0.0 for r in v)
        out["methods"][name] = m
    return out


def table(result: dict) -> str:
    lines = [f"\n{'method':<16}{'wall (median)':>14}{'tokens/s':>13}{'× script':>10}"
             f"{'first step':>12}{'steady tok/s':>14}"]  # fmt: skip
    for name, m in result["methods"].items():
        ttfs = m.get("time_to_first_step_s")
        steady = m.get("steady_tokens_per_s")
        lines.append(
            f"{name:<16}{m['wall_median_s']:>13.2f}s{m['tokens_per_s']:>13,.0f}"
            f"{m['speed_over_script']:>10.2f}"
            + (f"{ttfs:>11.2f}s" if ttfs is not None else f"{'-':>12}")
            + (f"{steady:>14,.0f}" if steady is not None else f"{'-':>14}")
        )
    lines.append("wall = process start to exit; × script = the script's wall / this wall")
    return "\n".join(lines)


def hf_single_process_rate(cfg, units: int = 12) -> float:
    from pipeline.read.reading import iter_blocks_local
    from pipeline.stages.documents import DocSource
    from pipeline.tokenize.engines import load_tokenizer

    load_tokenizer(cfg.tokenizer)
    stream = cfg.streams["corpus"]
    todo = DocSource("corpus", 0, cfg, iter_blocks_local).units(0)[:units]
    t, n = time.perf_counter(), 0
    for block in iter_blocks_local(todo, stream, cfg.tokenizer):
        n += sum(len(c.values) for c in block.column("tokens").chunks)
    return n / (time.perf_counter() - t)


def run_hf(corpus: list[str], cpus: int) -> int:
    """`--hf`: `backend: hf` exports, on a warm pool and on Ray Data tasks, against its limit."""
    from pipeline.read.resolve import parse_config

    config = {"seq_len": 2048, "global_batch_size": 16, "packing": {"mode": "concat"},
              "tokenizer": {"backend": "hf"},
              "streams": {"corpus": {"paths": [str(Path(f).resolve()) for f in corpus]}}}  # fmt: skip
    limit = cpus * hf_single_process_rate(parse_config(config))
    print(f"limit: {cpus} x single-process hf = {limit:,.0f} tokens/s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="tokenmill-hf-"))
    head = RayHead(cpus)
    try:
        path = work / "hf.yaml"
        path.write_text(json.dumps(config))
        env = dict(os.environ, TOKENMILL_RAY_ADDRESS="", RAY_ADDRESS="")
        pool = ["--pool", str(cpus)]
        for i, (name, extra) in enumerate([("pool (creates it)", pool), ("pool", pool),
                                           ("pool", pool), ("Ray Data tasks", [])]):  # fmt: skip
            out = work / f"o{i}"
            cmd = [str(BIN / "tokenmill"), "export", "--config", str(path), "--out", str(out),
                   "--address", head.address, *extra]  # fmt: skip
            subprocess.run(cmd, env=env, capture_output=True, check=True)
            s = json.loads((out / "summary.json").read_text())
            steady = s["steady_tokens_per_s"]
            print(f"{name:<18} wall {s['wall_s']:6.2f}s  steady {steady:>11,.0f} tokens/s  "
                  f"= {steady / limit:.2f} x limit", flush=True)  # fmt: skip
    finally:
        head.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
