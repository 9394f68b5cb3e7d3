"""How far ahead the control asks the lanes: steps a call, chunks in flight, and the depth
that follows whether the control waited on lanes that have cores of their own.

The control (`LanedFeed`) asks every lane for the same steps at once, one call a lane (a
chunk), and keeps `depth` chunks asked ahead of the one it joins: deep enough that a lane
busy reading a unit does not stop the others, shallow enough that a weight change, which
lands after the steps asked, waits for few steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.config import Config
from wire.protocol import WINDOW_BYTES

if TYPE_CHECKING:
    from pipeline.lanes.steps import LaneMade

STEPS_PER_CALL = 4  # lane steps asked for at once (one actor call per lane), at least


def steps_per_call(lanes: int) -> int:
    """Steps asked of each lane per call: STEPS_PER_CALL, or 2K past it, so that the control
    submits about one lane call per two global steps and takes one answer, whatever K (a
    chunk is K calls).
    - At 4 steps a call, the control's CPU per step grew with K: 16 lanes on 2 cores, 8 ranks,
      pre-tokenized (`bench.serve_ranks`), 4.7 ms per step, a quarter of it submitting calls
      and a quarter taking the answers apart (py-spy).
    - At K steps a call, submitting the calls and taking the answers were still a third of
      the time the control held the GIL (16 lanes, 16 ranks; py-spy --gil), hence 2K, with
      half as many chunks in flight (`in_flight`): the steps made ahead stay the same."""
    return max(STEPS_PER_CALL, 2 * lanes)


# Steps asked for ahead of the chunk being joined (actors only), in chunks of
# steps_per_call(K). With one chunk ahead, a lane idled for a round trip after every chunk
# (its next was asked once its answer was back) and between the ranks' bursts. Served
# pre-tokenized, 2 lanes on 2 cores, 4 steps a call (bench.serve_ranks, one run each): 5.7M
# tokens/s with 1 chunk ahead, 7.7M with 2, 10.1M with 3, 12.2M with 4 (8 steps x 2: 10.6M).
# A weight change lands after the steps asked: up to in_flight(K) x steps_per_call(K) steps
# while the lanes keep ahead (more while the control waits on them: `most_in_flight`).
IN_FLIGHT = 4


def in_flight(lanes: int) -> int:
    """Chunks asked for ahead: at least IN_FLIGHT chunks of STEPS_PER_CALL steps' worth (16
    steps: 3 chunks of 6 at 3 lanes), and at least two (one being made while the one before
    is answered)."""
    return max(2, -(-IN_FLIGHT * STEPS_PER_CALL // steps_per_call(lanes)))


# While the control waits on the lanes, it asks more chunks ahead, up to a read unit's tokens
# a lane (`most_in_flight`). A lane reads and tokenizes a whole read unit (up to
# `read.block_bytes`) in the step that first needs it: at 16 lanes a unit of 8 MiB is ~450 of
# a lane's steps and ~0.2 s of a core, and every other lane, whose steps wait for this one's,
# stops once it has made the chunks asked of it. `python -m bench lane-rates --window` replays each
# lane's time per step (each alone on a core) as the control asks them: 16 lanes of 128 MiB
# of Python sources made 0.65 of the slowest lane's own rate 2 chunks of 32 steps ahead, 0.98
# at 8 and 1.00 at 16.
# While the lanes keep ahead, the control waits on no answer and asks `in_flight` chunks
# again: a weight change lands after the steps asked, so the depth returns to where it costs
# least (pipeline/lanes/feed.py `LanedFeed._fill`).
BYTES_PER_TOKEN = 4  # a read unit's tokens, roughly: text (~4 bytes a token) or int32 ids
MOST_AHEAD_STEPS = 1024


def most_in_flight(cfg: Config) -> int:
    """The most chunks asked ahead: a read unit's tokens of one lane's steps (at most
    MOST_AHEAD_STEPS, and the WINDOW_BYTES the control's window may hold), at least
    `in_flight`."""
    lanes = cfg.lanes
    lane_step = cfg.global_batch_size // lanes * cfg.seq_len  # tokens of a lane's step
    steps = min(-(-cfg.read.block_bytes // BYTES_PER_TOKEN // lane_step), MOST_AHEAD_STEPS,
                WINDOW_BYTES // (cfg.global_batch_size * cfg.seq_len * 4))  # fmt: skip
    return max(in_flight(lanes), -(-steps // steps_per_call(lanes)))


# A lane "has a core" when its process used at least this share of one while it made its
# last chunk. Where lanes share cores (16 lanes on 2), a lane that waits leaves no core idle
# that a deeper bank could use, and asking further ahead cost there (every lane busy at
# once): 16 lanes and 16 ranks on 2 cores served 6.10M and 4.49M tokens/s against 6.90M and
# 6.75M, their lanes 15.3 and 16.7 ms of CPU a step against 13.6 and 13.9.
CORED = 0.75


def had_cores(before: list[tuple[float, float]], answers: list[LaneMade]
              ) -> tuple[bool, list[tuple[float, float]]]:  # fmt: skip
    """Whether the lanes had cores of their own making `answers` (one LaneMade a lane): their
    processes' CPU over their making time since `before` (each lane's `making_s`,
    `making_process_s` at its last answer), summed over the lanes, at least CORED; and the
    figures to compare the next answers with. A lane that made nothing keeps its figures."""
    wall = cpu = 0.0
    after = list(before)
    for k, made in enumerate(answers):
        if not len(made):
            continue
        wall += made.making_s - before[k][0]
        cpu += made.making_process_s - before[k][1]
        after[k] = (made.making_s, made.making_process_s)
    return wall > 0 and cpu >= CORED * wall, after


def next_depth(depth: int, waited: bool, least: int, most: int) -> int:
    """The chunks to ask ahead after joining one: twice as many after waiting on lanes that
    have cores of their own (`waited`: they are the bottleneck, and a deeper bank lets a
    lane's burst pass while the others go on), else one fewer (the lanes keep ahead, or share
    their cores: fewer steps for a weight change to wait)."""
    return min(most, depth * 2) if waited else max(least, depth - 1)
