"""Lanes: K independent feeds that each make G/K rows of every global step.

    every stream's pieces ──lane_shares──▶ lane 0: read, shuffle, mix, pack ─▶ rows [0, G/K)
                                          lane 1: …                         ─▶ rows [G/K, 2G/K)
                                          …
    global step s = lane 0's step s ‖ lane 1's step s ‖ … (rows in lane order)

A lane is a `StepFeed` (pipeline/feed.py) over its share of every stream: a balanced partition of
the stream's pieces by bytes (stages/plan.py `lane_shares`), its own seeded orders, the
same weights, its own token-exact mixer and packer. Each lane runs in a process of its own (a
Ray actor, placed with `service.resources`; in-process lanes for `--local`), so mixing and
packing scale with lanes as tokenizing scales with workers: no process handles every token
but the one that writes them (an export) or serves them.

- The sequence is a pure function of (config, seed, lanes), never of the world size: rank r
  of W takes rows [r·G/W, (r+1)·G/W) of each global step, whichever lanes made them. One lane
  is the sequence a config always had (its hash leaves `lanes: 1` out); changing the number of
  lanes is a new sequence, as Mosaic's `num_canonical_nodes` is.
- Mixing stays exact: every lane mixes by tokens with the same weights, within one segment
  of its targets at every step, so every global prefix that ends at a step is within K
  segments (K rows' tokens) of each stream's target share.
- A weight change takes effect at one global step in every lane: the first step no lane has
  begun (`set_weights`), recorded in each lane's mixture history.
- End of data: the sequence ends at the first step that some lane cannot make whole; with
  `drop_last` it ends before that step, else that step is the last, each lane's rows of it
  in lane order (the one step whose rows a lane may not fill).
- One resume state: `{version, config_hash, step, lanes: [lane 0's state, …], digest}`, sealed
  like a feed's (state/resume.py `check_laned_state`); a state with another number of lanes is
  refused with a named error.

The package, one concern a module: `depth` (how far ahead the control asks), `steps` (what a
lane answers and a rank is told), `worker` (a lane's own process), `handles` (a lane as the
control calls it), `group` (the K lanes as the control holds them: started, called, started
again, shown), `restart` (what is kept to start a dead lane again from its state), `placing`
(an actor no node can hold fails the run, naming it), `figures` (a run's figures joined from
the lanes'), `chunks` (`ChunkPlan`: which steps the control asks of the lanes, and when),
`feed` (`LanedFeed`, the control's side: the lanes asked ahead, their answers joined into
global steps).
"""

from pipeline.lanes.depth import (
    CORED,
    IN_FLIGHT,
    STEPS_PER_CALL,
    had_cores,
    in_flight,
    most_in_flight,
    next_depth,
    steps_per_call,
)
from pipeline.lanes.feed import LanedFeed
from pipeline.lanes.steps import (
    PENDING,
    LanedStep,
    LaneError,
    LaneMade,
    Receipt,
    Writes,
    served_counts,
    where,
)
from pipeline.lanes.worker import TAKE_WAIT_S, LaneWorker

__all__ = [
    "CORED",
    "IN_FLIGHT",
    "PENDING",
    "STEPS_PER_CALL",
    "TAKE_WAIT_S",
    "LaneError",
    "LaneMade",
    "LaneWorker",
    "LanedFeed",
    "LanedStep",
    "Receipt",
    "Writes",
    "had_cores",
    "in_flight",
    "most_in_flight",
    "next_depth",
    "served_counts",
    "steps_per_call",
    "where",
]
