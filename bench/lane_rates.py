"""Each lane's own rate: what bounds K lanes when each has a core.

    python -m bench.lane_rates [--lanes 16] [--corpus FILE.jsonl] [--steps 600] [--json PATH]

Every global step needs all K lanes' parts, so K lanes serve at most K × the slowest lane's
rate, however many cores they have. This bench makes each lane's steps alone, one after the
other, in this process (`LaneWorker`, reading its share itself as `read.in_lanes` does, and
holding its steps as the batch server's lanes do, each step's rows taken by the one rank of
a world of K whose rows it holds), on a text stream (`--corpus`, default the demo corpus's
code.jsonl, read `repeat` 1000), seq_len 2048, global batch 32, concat. Per lane: tokens/s
over `--steps` lane steps after a warm-up call, and the share of its characters that the HF
check encoded again (`LoadedTokenizer.encode_verified`, `verify_sample`). Then the slowest lane, the spread, and
K × the slowest: the laned feed's bound on this core's speed. Then the baseline, measured in
the same run: one lane of `lanes: 1` (the whole step, G rows) alone, and the ratio the
16-core goal turns on, K × the slowest ÷ (K × the one lane's rate): what a core making a
lane's share of each step keeps of what it makes as the only lane (a lane's cost is partly
per step, whatever its rows).

The demo corpus is the running Python's standard library, so it differs between Pythons: with
Python 3.12's, lane 0 of 16 holds one 796k-character document, which the HF check used to
encode whole (that lane made 0.57M tokens/s, the others 4-5M).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SEQ_LEN, BATCH = 2048, 32


def lane_rates(corpus: str, lanes: int, steps: int, only: list[int] | None = None) -> list[dict]:
    """Each lane's tokens/s making `steps` lane steps alone, and its checked share."""
    from pipeline.lanes import LaneWorker, steps_per_call
    from pipeline.read.resolve import parse_config
    from pipeline.tokenize import engines

    cfg = parse_config({"seq_len": SEQ_LEN, "global_batch_size": BATCH,
                        "packing": {"mode": "concat"}, "lanes": lanes,
                        "streams": {"text": {"paths": [corpus], "repeat": 1000}}})  # fmt: skip
    seen = [0, 0]  # characters encoded, characters checked
    encode = engines.LoadedTokenizer.encode_verified

    def counting(self, texts):
        seen[0] += sum(len(t) for t in texts)
        seen[1] += sum(b - a for _, a, b in engines.verify_sample(texts, self.verify_fraction))
        return encode(self, texts)

    engines.LoadedTokenizer.encode_verified = counting  # type: ignore[method-assign]
    out = []
    try:
        for k in range(lanes) if only is None else only:
            # As the batch server runs a lane: holding its steps (compact), a state every step,
            # and its rows taken by the rank of a world of K whose rows it holds.
            lane = LaneWorker(cfg.model_dump(mode="json", context={"reveal_secrets": True}), k,
                              None, False, False, True, False, hold=True)  # fmt: skip
            per_call = steps_per_call(lanes)  # as the batch server asks
            lane.steps(per_call, 0)  # warm: the tokenizer loaded, the first read begun
            seen[:] = [0, 0]
            t, n = time.perf_counter(), per_call
            while n < steps + per_call:
                made, _ = lane.steps(per_call, 1, n)
                if not len(made):
                    break
                lane.take([(made.first + j, 0, int(r)) for j, r in enumerate(made.rows)], k, lanes)
                n += len(made)
            n -= per_call
            wall = time.perf_counter() - t
            lane.close()
            out.append({"lane": k, "steps": n, "tokens_per_s": n * SEQ_LEN * BATCH / lanes / wall,
                        "checked": seen[1] / max(1, seen[0])})  # fmt: skip
            print(f"  lane {k:>2}: {out[-1]['tokens_per_s'] / 1e6:6.2f}M tokens/s, HF check "
                  f"{out[-1]['checked']:.2%} of its characters", flush=True)  # fmt: skip
    finally:
        engines.LoadedTokenizer.encode_verified = encode  # type: ignore[method-assign]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--corpus", default=None, help="a JSONL text file (default: the demo's code)")
    ap.add_argument("--steps", type=int, default=600, help="lane steps per lane")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if BATCH % args.lanes:
        raise SystemExit(f"--lanes must divide {BATCH}")
    from service.demo_corpus import build_demo_corpus

    corpus = args.corpus or str(build_demo_corpus() / "code.jsonl")
    rows = lane_rates(corpus, args.lanes, args.steps)
    rates = [r["tokens_per_s"] for r in rows]
    slow = min(range(len(rates)), key=rates.__getitem__)
    print(f"{args.lanes} lanes: slowest lane {slow} at {rates[slow] / 1e6:.2f}M tokens/s, fastest "
          f"{max(rates) / 1e6:.2f}M (spread x{max(rates) / rates[slow]:.2f}); "
          f"{args.lanes} x the slowest = {args.lanes * rates[slow] / 1e6:.1f}M tokens/s, "
          f"the bound with a core per lane (the sum would be {sum(rates) / 1e6:.1f}M)")  # fmt: skip
    base = lane_rates(corpus, 1, max(200, args.steps // args.lanes), only=[0])[0]["tokens_per_s"]
    print(f"one lane (lanes: 1, {BATCH} rows a step): {base / 1e6:.2f}M tokens/s; "
          f"{args.lanes} x the slowest / ({args.lanes} x one lane) = {rates[slow] / base:.2f}, "
          f"the mean lane / one lane = {sum(rates) / len(rates) / base:.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"corpus": corpus, "lanes": rows,
                                               "one_lane_tokens_per_s": base}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
