"""`tokenmill demo`: the main job on the embedded default.

1. Builds the demo corpus from the standard library (service/demo_corpus.py): module sources
   as a pretraining stream, function/docstring pairs as a chat stream.
2. Starts an embedded local Ray and the tokenmill service on it (batch server actor), mixing
   the two streams 70/30 by tokens.
3. Runs the thin trainer as two CPU ranks under torchrun (gloo) for `--steps` steps; the
   ranks pull their rows from the service through `trainer.feed.Feed`.
4. Prints the summary: tokens/s, packing efficiency, realized mixture against target,
   data-wait fraction, first and last loss, each stream's loss; with `--policy`, the mixing
   policy's decisions (the weight history it wrote). Leaves no process behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.read.resolve import parse_config
from service.demo_corpus import build_demo_corpus

RANKS = 2
# The ranks' malloc: each step's logits (rows x 100k vocabulary, ~200 MB a rank) and their
# gradients are blocks glibc would mmap, unmap at free and fault in again the next step; from
# the heap, kept (for the ranks only), `demo --steps 10 --policy` took 32 s instead of 38 s on a
# 2-core VM (17 -> 7 s in the kernel), the same losses. A user's own GLIBC_TUNABLES wins.
RANKS_MALLOC = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967295"


def demo_config(corpus: Path) -> dict:
    return {
        "seed": 1234,
        # Small rows: on two shared CPU cores the 100k-vocabulary LM head dominates a step.
        "seq_len": 256,
        "global_batch_size": 4,
        "tokenizer": {"name": "default"},
        "packing": {"mode": "bfd", "buffer": 128, "overflow": "split"},
        "shuffle": {"window": 64},
        "on_error": "skip",
        "streams": {
            "code": {"kind": "pretrain", "paths": [str(corpus / "code.jsonl")], "weight": 0.7},
            "chat": {"kind": "chat", "paths": [str(corpus / "chat.jsonl")], "weight": 0.3},
        },
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `demo --policy`: the mixing policy on (README "Mixing that follows the loss"). A decision
# every 5 steps, from the loss of 5 steps, 18 steps after them: while the producer waits for
# a window's loss, the ranks train on the 18 steps made (data wait 0.04% measured).
DEMO_POLICY = {"every": 5, "delay": 18, "eta": 1.0}


def run_demo(
    steps: int = 60, out: str | None = None, address: str | None = None, policy: bool = False
) -> dict:
    import ray

    from client.cluster import connect, shutdown
    from service.serve import _close, start_server

    corpus = build_demo_corpus()
    print(f"demo corpus: {corpus}", flush=True)
    spec = demo_config(corpus)
    if policy:
        spec["mixing"] = {"policy": DEMO_POLICY}
    cfg = parse_config(spec)
    started = connect(address)
    name = f"tokenmill-demo-{os.getpid()}"
    actor = start_server(cfg, name=name, prefetch=16)
    gcs = ray.get_runtime_context().gcs_address
    work = Path(out or tempfile.mkdtemp(prefix="tokenmill-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    log_json = work / "train.jsonl"
    log_json.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "-m", "trainer.train", "--service", name, "--address", gcs, "--steps", str(steps),
        "--lr", "2e-3", "--log-json", str(log_json),
    ]  # fmt: skip
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "TOKENMILL_RAY_LOGS": "0",
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", RANKS_MALLOC),
    }
    try:
        print(
            f"trainer: {RANKS} CPU ranks (gloo) x {steps} steps, pulling from service {name!r}",
            flush=True,
        )
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        lines = proc.stdout.splitlines()
        for line in lines:
            head = line.split(" ", 1)[0]
            if line.startswith("global batch") or (
                head.startswith("step=") and (int(head[5:]) % 10 == 0 or head == "step=1")
            ):
                print("  " + line, flush=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"the trainer failed (exit {proc.returncode}); its output:\n"
                + "\n".join(lines[-30:])
            )
        train = next(
            json.loads(line)["summary"] for line in reversed(lines) if line.startswith('{"summary"')
        )
        metrics = ray.get(actor.metrics.remote(), timeout=30)
    finally:
        _close(actor)
        shutdown(started)
    mixture = {
        n: {"target": s["target_share"], "realized": s["realized_share"]}
        for n, s in metrics["streams"].items()
    }
    summary = {
        "steps": train["steps"],
        "tokens_per_s": train["tokens_per_s"],
        "service_tokens_per_s": metrics["tokens_per_s"],
        "packing_efficiency": metrics["packing_efficiency"],
        "data_wait_fraction": train["data_wait_fraction"],
        "data_wait_fraction_all_steps": train["data_wait_fraction_all_steps"],
        "first_step_wait_s": train["first_step_wait_s"],
        "mixture": mixture,
        "loss_first": train["loss_first"],
        "loss_last": train["loss_last"],
        "streams": metrics["streams"],
        # The ranks' loss per stream (trainer.train reports it each step), over the last
        # steps the service joined: what `mixing` would follow (docs, "When a run misbehaves").
        "stream_loss": {n: v["loss"] for n, v in metrics["stream_loss"]["streams"].items()},
        "train_log": str(log_json),
        # With --policy: each decision's step, the window's loss per stream and the weights.
        "policy": (metrics.get("policy") or {}).get("decisions"),
        "policy_config": dict(DEMO_POLICY, weights=cfg.weights) if policy else None,
    }
    print_demo_summary(summary)
    return summary


def print_demo_summary(s: dict) -> None:
    print()
    print(f"steps              {s['steps']}")
    print(f"trained tokens/s   {s['tokens_per_s']:,.0f}")
    print(f"packing            {100 * s['packing_efficiency']:.2f}% real tokens")
    print(f"data wait          {100 * s['data_wait_fraction']:.2f}% of step time (steady state; "
          f"first step waited {s['first_step_wait_s']:.1f}s for the service to start)")  # fmt: skip
    print(f"loss               {s['loss_first']:.3f} -> {s['loss_last']:.3f}")
    print(f"{'stream':<10}{'target':>8}{'realized':>10}{'tokens':>12}{'docs':>8}{'skipped':>9}"
          f"{'loss':>8}")  # fmt: skip
    for name, m in s["mixture"].items():
        st = s["streams"][name]
        loss = (s.get("stream_loss") or {}).get(name)
        shown = "-" if loss is None else f"{loss:.3f}"
        print(
            f"{name:<10}{m['target']:>8.3f}{m['realized']:>10.3f}{st['tokens']:>12,}"
            f"{st['docs']:>8,}{st['skipped']:>9,}{shown:>8}"
        )
    print("(loss: the ranks' mean loss per stream over the last steps they reported)")
    if s.get("policy") is not None:
        print("(target: the weights in effect now, the policy's last; realized: the whole run, "
              "which followed the weight history below)")  # fmt: skip
        print_policy(s["policy"], s.get("policy_config") or {}, s["steps"])


def print_policy(decisions: list[dict], policy: dict, trained: int) -> None:
    """The mixing policy's decisions: the weight history it wrote, with the loss behind it."""
    print()
    if policy:
        start = ", ".join(f"{n} {w:.3f}" for n, w in policy["weights"].items())
        print(f"mixing policy: a decision every {policy['every']} steps, from the mean loss of "
              f"{policy['every']} steps, {policy['delay']} steps after them (eta "
              f"{policy['eta']}); the config's weights: {start}")  # fmt: skip
    if not decisions:
        print("no decision yet (the first comes at step every + delay)")
        return
    names = list(decisions[0]["weights"])
    print(f"{len(decisions)} decision(s): the weights from each step, and the window's mean "
          f"loss they follow (* made ahead of the {trained} steps trained)")  # fmt: skip
    print(f"{'step':>6}  {'window':>9}  " + "  ".join(f"{n + ' loss':>10}{n:>7}" for n in names))
    for d in decisions:
        lo, hi = d["window"]
        cells = []
        for n in names:
            loss = d["loss"].get(n)
            cells.append(f"{'-' if loss is None else f'{loss:.3f}':>10}{d['weights'][n]:>7.3f}")
        ahead = "*" if d["step"] >= trained else " "
        print(f"{d['step']:>5}{ahead}  {f'{lo}-{hi - 1}':>9}  " + "  ".join(cells))
