"""Each lane's own rate: what bounds K lanes when each has a core.

    python -m bench lane-rates [--lanes 16] [--corpus FILE.jsonl] [--steps 600] [--read-ahead]
        [--json PATH]
    python -m bench lane-rates --window [--lanes 16] [--steps 4000] [--corpus ...] [--read-ahead]

Every global step needs all K lanes' parts, so K lanes serve at most K × the slowest lane's
rate, however many cores they have. This bench makes each lane's steps alone, one after the
other, in this process (`LaneWorker`, reading its share itself as `read.in_lanes` does, and
holding its steps as the batch server's lanes do, each step's rows taken by the one rank of
a world of K whose rows it holds), on a text stream read `repeat` 1000 (`--corpus`: the demo
corpus's code.jsonl by default; `site-packages` for a large one, bench/corpora.py), seq_len
2048, global batch 32, concat.

Per lane: tokens/s over the second half of `--steps` lane steps (steady), and the share of
its characters that the HF check encoded again (`LoadedTokenizer.encode_verified`,
`verify_sample`). A lane tokenizes a read unit at a time, so a half shorter than a few units
says little: a lane whose half read under 0.8x or over 1.25x its whole run's characters per
step is flagged (more `--steps`; 2,000 at 16 lanes flags none on either corpus here). Then the slowest lane, the spread, and K × the slowest: the laned feed's
bound on this core's speed. Then the baseline, measured in the same run: one lane of
`lanes: 1` (the whole step, G rows) alone, making the K lanes' tokens (steady), and
the ratio the 16-core goal turns on, K × the slowest ÷ (K × the one lane's rate): what a
core making a lane's share of each step keeps of what it makes as the only lane (a lane's
cost is partly per step, whatever its rows).

The corpus decides the spread. The demo corpus is ~580 documents: 16 lanes hold ~36 each,
and their shares differ (the fastest lane made ×1.31–1.35 the slowest's rate on Python
3.11's stdlib). The site-packages corpus (128 MiB, ~10,000 documents) gives each lane
hundreds: ×1.08–1.13. `tokenmill check` predicts the slowest lane from each share's bytes per
token.

`--window`: do the chunks asked ahead absorb the lanes' bursts? A lane reads and tokenizes a
read unit at a time, so its cost per step comes in bursts: the step that needs the next unit
pays for all of it (at 16 lanes and 8 MiB units, ~0.2 s of a core every ~450 steps, ~0.5 ms
the others). The control asks every lane for the same chunk of steps (`steps_per_call`), a
number of chunks ahead of the one it joins (`LanedFeed.depth`), and asks the next only once it
has joined one, which needs every lane's part: so a lane in a burst stops the others once they
have made what was asked of them. With a core per lane, a burst costs nothing if the chunks
asked ahead outlast it. With `--window` each lane's steps are made alone as above, one step a
call, and the time of each step recorded; then the K lanes' times are replayed together, each
lane on a core of its own, as the control asks them: chunk c goes to every lane once every
lane has made chunk c - depth - 1; the ranks take each joined step at once. It prints the
replay's steps per second, and ÷ the slowest lane's own rate (1.00: the chunks asked ahead
cost nothing), for the depths the control uses: `in_flight` while the lanes keep ahead, up to
`most_in_flight` while it waits on them (pipeline/lanes/depth.py). A model, not a served run:
it leaves out the control's and the ranks' CPU and Ray's calls. A step made alone in a call
carries that call's cost, which comes with every step alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SEQ_LEN, BATCH = 2048, 32


def bench_config(corpus: str, lanes: int):
    """The config each lane runs here: one text stream read `repeat` 1000, L 2048, G 32."""
    from pipeline.read.resolve import parse_config

    return parse_config({"seq_len": SEQ_LEN, "global_batch_size": BATCH,
                         "packing": {"mode": "concat"}, "lanes": lanes,
                         "streams": {"text": {"paths": [corpus], "repeat": 1000}}})  # fmt: skip


def lane_rates(corpus: str, lanes: int, steps: int, only: list[int] | None = None,
               ahead: bool = False) -> list[dict]:  # fmt: skip
    """Each lane's tokens/s making `steps` lane steps alone, and its checked share."""
    from pipeline.lanes import LaneWorker, steps_per_call
    from pipeline.tokenize import engines

    cfg = bench_config(corpus, lanes)
    seen = [0, 0, 0]  # characters encoded, characters checked (timed half); encoded (whole run)
    encode = engines.LoadedTokenizer.encode_verified

    def counting(self, texts):
        seen[0] += sum(len(t) for t in texts)
        seen[2] += sum(len(t) for t in texts)
        seen[1] += sum(b - a for _, a, b in engines.verify_sample(texts, self.verify_fraction))
        return encode(self, texts)

    engines.LoadedTokenizer.encode_verified = counting  # type: ignore[method-assign]
    out = []
    try:
        for k in range(lanes) if only is None else only:
            # As the batch server runs a lane: holding its steps (compact), a state every step,
            # and its rows taken by the rank of a world of K whose rows it holds.
            seen[:] = [0, 0, 0]
            lane = LaneWorker(cfg.model_dump(mode="json", context={"reveal_secrets": True}), k,
                              None, False, False, True, False, hold=True,
                              read_ahead=ahead)  # fmt: skip
            per_call = steps_per_call(lanes)  # as the batch server asks
            lane.steps(per_call, 0)  # warm: the tokenizer loaded, the first read begun
            # Steady: timed over the second half of the steps. The first epoch is read in
            # small units first (read.first_block_bytes), slower per token: on a corpus of
            # 128 MiB one lane took ~2 s to reach its rate, longer than a short run.
            n, half = per_call, per_call + steps // 2
            t, timed_from = time.perf_counter(), n
            while n < steps + per_call:
                made, _ = lane.steps(per_call, 1, n)
                if not len(made):
                    break
                lane.take([(made.first + j, 0, int(r)) for j, r in enumerate(made.rows)], k, lanes)
                n += len(made)
                if half is not None and n >= half:
                    seen[:2] = [0, 0]
                    t, half, timed_from = time.perf_counter(), None, n
            wall = time.perf_counter() - t
            lane.close()
            # A lane tokenizes a read unit at a time (up to read.block_bytes): a timed half
            # shorter than a few units reads more or less than it serves, and its rate says
            # little. Its characters read per step, against the whole run's:
            read = (seen[0] / max(1, n - timed_from)) / (seen[2] / max(1, n))
            n -= timed_from
            out.append({"lane": k, "steps": n, "tokens_per_s": n * SEQ_LEN * BATCH / lanes / wall,
                        "checked": seen[1] / max(1, seen[0]), "read": read})  # fmt: skip
            if not 0.8 <= read <= 1.25:
                print(f"  lane {k:>2}: its timed half read {read:.2f}x the characters a step of "
                      "its whole run: too few --steps for its read units, its rate is not "
                      "steady")  # fmt: skip
            print(f"  lane {k:>2}: {out[-1]['tokens_per_s'] / 1e6:6.2f}M tokens/s, HF check "
                  f"{out[-1]['checked']:.2%} of its characters", flush=True)  # fmt: skip
    finally:
        engines.LoadedTokenizer.encode_verified = encode  # type: ignore[method-assign]
    return out


def step_times(cfg, steps: int, ahead: bool) -> np.ndarray:
    """[lane, step]: each lane's seconds per step, made alone, one step a call; reading its
    share ahead on a thread of its own (`ahead`, as a lane actor does) or as it packs."""
    from pipeline.lanes import LaneWorker

    lanes = cfg.lanes
    times = np.zeros((lanes, steps))
    for k in range(lanes):
        lane = LaneWorker(cfg.model_dump(mode="json", context={"reveal_secrets": True}), k,
                          None, False, False, True, False, hold=True, read_ahead=ahead)  # fmt: skip
        lane.steps(8, 0)  # warm: the tokenizer loaded, the first read begun
        n = 8
        for s in range(steps):
            t = time.perf_counter()
            made, _ = lane.steps(1, 1, n)
            lane.take([(made.first, 0, int(made.rows[0]))], k, lanes)
            times[k, s] = time.perf_counter() - t
            n += 1
        lane.close()
        print(f"  lane {k:>2}: median {np.median(times[k]) * 1e3:.2f} ms a step, p99 "
              f"{np.percentile(times[k], 99) * 1e3:.1f} ms, max {times[k].max() * 1e3:.1f} ms",
              flush=True)  # fmt: skip
    return times


def replay(times: np.ndarray, per_call: int, depth: int) -> float:
    """Steps per second of the K lanes as the control asks them: in chunks of `per_call`
    steps, `depth` chunks ahead of the one it joins. Chunk c goes to every lane once every lane
    has made chunk c - depth - 1 (the control asks it after joining that one), and a lane makes
    its chunks in order; the ranks take each joined step at once (saturated: the window of
    handed-out steps is never full)."""
    lanes, steps = times.shape
    chunks = steps // per_call
    cost = times[:, : chunks * per_call].reshape(lanes, chunks, per_call).sum(axis=2)
    done = np.zeros(lanes)
    joined = np.zeros(chunks)
    for c in range(chunks):
        gate = joined[c - depth - 1] if c > depth else 0.0
        done = np.maximum(done, gate) + cost[:, c]
        joined[c] = done.max()
    return chunks * per_call / joined[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lane-rates", description=__doc__)
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--corpus", default=None, help="a JSONL text file, or site-packages[:MB] "
                    "(bench/corpora.py; default: the demo's code)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=None,
                    help="lane steps per lane (default 600; 4000 with --window)")  # fmt: skip
    ap.add_argument("--read-ahead", action="store_true", help="each lane reads on a thread "
                    "of its own, as `read.ahead: true` has a lane actor do (default: False)")  # fmt: skip
    ap.add_argument("--window", action="store_true", help="replay each lane's time per step "
                    "as the control asks them, at each depth it uses (see above)")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if BATCH % args.lanes:
        raise SystemExit(f"--lanes must divide {BATCH}")
    from bench.corpora import resolve_corpus

    corpus = str(resolve_corpus(args.corpus))
    if args.window:
        return window(corpus, args.lanes, args.steps or 4000, args.read_ahead)
    args.steps = args.steps or 600
    rows = lane_rates(corpus, args.lanes, args.steps, ahead=args.read_ahead)
    rates = [r["tokens_per_s"] for r in rows]
    slow = min(range(len(rates)), key=rates.__getitem__)
    print(f"{args.lanes} lanes: slowest lane {slow} at {rates[slow] / 1e6:.2f}M tokens/s, fastest "
          f"{max(rates) / 1e6:.2f}M (spread x{max(rates) / rates[slow]:.2f}); "
          f"{args.lanes} x the slowest = {args.lanes * rates[slow] / 1e6:.1f}M tokens/s, "
          f"the bound with a core per lane (the sum would be {sum(rates) / 1e6:.1f}M)")  # fmt: skip
    # The baseline makes the K lanes' tokens together: its steady half then covers as much of
    # the corpus as the lanes' runs do (on 128 MiB of site-packages, one lane's rate over 2 s
    # ranged 5.8M-13.3M tokens/s with what it read: a shorter run measures a part of it).
    base = lane_rates(corpus, 1, args.steps, only=[0], ahead=args.read_ahead)[0]["tokens_per_s"]
    print(f"one lane (lanes: 1, {BATCH} rows a step): {base / 1e6:.2f}M tokens/s; "
          f"{args.lanes} x the slowest / ({args.lanes} x one lane) = {rates[slow] / base:.2f}, "
          f"the mean lane / one lane = {sum(rates) / len(rates) / base:.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"corpus": corpus, "lanes": rows,
                                               "one_lane_tokens_per_s": base}, indent=2) + "\n")  # fmt: skip
    return 0


def window(corpus: str, lanes: int, steps: int, ahead: bool) -> int:
    """`--window`: each lane's time per step, replayed at the depths the control uses."""
    from pipeline.lanes import in_flight, most_in_flight, steps_per_call

    cfg = bench_config(corpus, lanes)
    times = step_times(cfg, steps, ahead)
    own = steps / times.sum(axis=1)
    per_call, least, most = steps_per_call(lanes), in_flight(lanes), most_in_flight(cfg)
    print(f"{lanes} lanes alone: {own.min():.0f} to {own.max():.0f} steps/s. Replayed as "
          f"the control asks them ({per_call} steps a call), steps/s and ÷ the slowest lane's "
          "own rate:")  # fmt: skip
    for depth in sorted({least, 2 * least, 4 * least, most}):
        r = replay(times, per_call, depth)
        mark = {least: "   (in_flight: the least, while the lanes keep ahead)",
                most: "   (most_in_flight: the most, while the control waits on the lanes)"}  # fmt: skip
        print(f"  {depth:>2} chunks ahead ({depth * per_call:>4} steps): {r:>6.0f} steps/s, "
              f"{r / own.min():.3f}{mark.get(depth, '')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
