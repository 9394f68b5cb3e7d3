"""Mixing that follows the loss (`mixing.policy`, opt-in): when and how the weights change.

The rule is DoReMi's domain-weight update (Xie et al. 2023, "DoReMi: Optimizing Data Mixtures
Speeds Up Language Model Pretraining", Algorithm 1), run online against the model being
trained, with its loss reported per stream by the trainer ranks (`trainer.feed.stream_loss`):

    excess_s  = max(loss_s - reference_s, 0)            reference: 0 unless configured
    alpha     = softmax(log w_s + eta * excess_s)         w: the weights in effect
    w'        = (1 - smoothing) * alpha + smoothing * w0  w0: the config's weights
    w'        = the nearest point of {lo_s <= w'_s <= hi_s, sum = 1}  (the bounds)

A stream whose loss stays high gains weight, geometrically, up to its bound; one whose loss
is at or under its reference keeps only what the others leave. DoReMi's reference is a
reference model's loss per domain; without one (`reference` unset) the excess is the loss
itself, which is "online data mixing" with loss as the reward (Albalak et al. 2023). A stream
with no labelled token in a window has no signal: its weight is kept, the others share the
rest.

When: decision k (k = 1, 2, ...) reads the mean loss of steps [k*N - N, k*N) (`every` N) and
takes effect at step k*N + D (`delay` D). D is there because the service makes steps ahead
of training: while a rank trains step s, up to `prefetch` steps after s are made already, and
the weights of made steps can no longer change. With D at least the prefetch window the
decision never holds the producer up; a smaller D acts on fresher loss and waits for it.

Why it is exactly resumable: a decision is a pure function of the weights in effect (the
mixer's history, in the state), the config, and the mean loss of a window of steps. The
weights chosen are in the state's history; the loss of a window that a state's resume still
has to decide from is carried with the state the service hands to a rank (`LOSSES`), so a
resumed run makes the same decisions from the same numbers, never from a different history.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from pipeline.config import PolicyConfig

# The key of the state the service hands out (service/batch_server.py `state`) under which the
# window losses a resume still needs travel: {"<step>": {stream: [loss sum, tokens]}}.
LOSSES = "policy_losses"
SOURCE = "policy"  # the mixture history's source of the weights the policy chose


def window_for(step: int, every: int, delay: int) -> tuple[int, int] | None:
    """The steps [lo, hi) whose loss decides the weights from `step`, if a decision takes
    effect there (step = k*every + delay, k >= 1); else None."""
    k, r = divmod(step - delay, every)
    if k < 1 or r:
        return None
    return (k - 1) * every, k * every


def windows_after(step: int, every: int, delay: int) -> list[tuple[int, int]]:
    """The windows of the decisions at `step` or later that hold a step before `step`: the
    loss a run resumed at `step` needs from before it."""
    out = []
    k = max(1, -(-(step - delay) // every))  # the first decision at or after `step`
    while (k - 1) * every < step:
        out.append(((k - 1) * every, k * every))
        k += 1
    return out


def project(v: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The point of {lo <= w <= hi, sum(w) = 1} nearest to `v` (Euclidean): w = clip(v - t,
    lo, hi) for the t that makes the sum 1, found by bisection (the sum falls as t grows).
    Needs sum(lo) <= 1 <= sum(hi) (the config checks it)."""
    a, b = float(np.min(v - hi)), float(np.max(v - lo))
    for _ in range(200):
        t = (a + b) / 2
        if np.clip(v - t, lo, hi).sum() > 1:
            a = t
        else:
            b = t
    w = np.clip(v - (a + b) / 2, lo, hi)
    return w / w.sum()  # the bisection's last 1e-16; keeps the mixer's sum-to-1 exact


def decide(
    policy: PolicyConfig,
    current: Mapping[str, float],
    base: Mapping[str, float],
    losses: Mapping[str, float | None],
) -> dict[str, float]:
    """The weights from the next decision step (module docstring), by stream name.

    `current`: the normalized weights in effect; `base`: the config's normalized weights;
    `losses`: each stream's mean loss over the decision's window (None: no labelled token)."""
    names = list(base)
    w = np.array([current[n] for n in names], dtype=np.float64)
    w0 = np.array([base[n] for n in names], dtype=np.float64)
    seen = np.array([losses.get(n) is not None for n in names])
    excess = np.array(
        [max(float(losses[n]) - policy.reference.get(n, 0.0), 0.0) if s else 0.0  # type: ignore[arg-type]
         for n, s in zip(names, seen, strict=True)]
    )  # fmt: skip
    alpha = w.copy()
    free = seen & (w > 0)
    if free.any():
        logits = np.log(w[free]) + policy.eta * excess[free]
        e = np.exp(logits - logits.max())
        alpha[free] = e / e.sum() * w[free].sum()  # streams without a signal keep theirs
    mixed = (1 - policy.smoothing) * alpha + policy.smoothing * w0
    lo, hi = policy.bounds_for(base)
    return dict(zip(names, project(mixed, lo, hi).tolist(), strict=True))


def needed_steps(step: int, every: int, delay: int) -> set[int]:
    """The steps before `step` whose loss the decisions at `step` or later read: what a
    state at `step` carries (`LOSSES`)."""
    return {s for lo, hi in windows_after(step, every, delay) for s in range(lo, min(hi, step))}


def check_losses(losses, names: list[str]) -> dict[int, dict[str, list[float]]]:
    """A state's carried window losses (`LOSSES`), checked: {step: {stream: [sum, tokens]}}.
    Raises ValueError naming the entry otherwise."""
    if not isinstance(losses, dict):
        raise ValueError(f"{LOSSES} must be an object, got {type(losses).__name__}")
    out: dict[int, dict[str, list[float]]] = {}
    for key, sums in losses.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 19) or not isinstance(
            sums, dict
        ):
            raise ValueError(f"{LOSSES}.{key}: expected a step and {{stream: [sum, tokens]}}")
        step: dict[str, list[float]] = {}
        for name, pair in sums.items():
            if name not in names or not _pair(pair):
                raise ValueError(f"{LOSSES}.{key}.{name}: expected a stream and [sum, tokens]")
            step[name] = [float(pair[0]), float(pair[1])]
        out[int(key)] = step
    return out


def _pair(pair) -> bool:
    """[loss sum, tokens]: two finite numbers >= 0 (not booleans), tokens < 2**40."""
    if not (isinstance(pair, list) and len(pair) == 2):
        return False
    for x in pair:
        if isinstance(x, bool) or not isinstance(x, int | float):
            return False
        try:
            if not (math.isfinite(x) and 0 <= x < 2**62):
                return False
        except OverflowError:
            return False
    return pair[1] < 2**40
