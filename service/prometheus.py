"""`/metrics`: the batch server's metrics and status as Prometheus text (service/api.py serves
it; `tokenmill status` and the page read the same figures as JSON)."""

from __future__ import annotations

from typing import Any

from pipeline.state.summary import stream_gauges

# Running totals are Prometheus counters (named `..._total`; `rate()` applies to them); a
# StreamSummary field not listed here stays a gauge. A counter may restart from a lower value
# when the service restarts or resumes from an earlier state: Prometheus reads that as a reset.
STREAM_COUNTERS = ("tokens", "docs", "skipped", "split", "truncated", "dropped")
PRODUCER_STATES = ("starting", "making", "window_full", "paused", "ended", "failed", "stopping",
                   "waiting_for_loss")  # fmt: skip


def prometheus_text(m: dict, st: dict) -> str:
    """`/metrics`: the batch server's metrics (`m`) and status (`st`) as Prometheus text.

    Running totals (tokens, rows, documents, skipped and rejected records, tokens per
    tokenizer backend) are counters named `..._total`; levels (rates, shares, lag, the global
    step, which moves back when ranks resume from an earlier state) are gauges. The
    producer's state is one gauge per state, 1 for the current one (`tokenmill_producer_state`).
    Fields a server does not report are left out, never reported as 0."""
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    reg.register(_Families(_families(m, st)))
    return generate_latest(reg).decode()


def _families(m: dict, st: dict) -> list:
    """Every family of one scrape, in the order the page and dashboards read them."""
    out = _Out()
    _the_run(out, m, st)
    _the_producer(out, m, st)
    _the_lanes(out, m)
    _the_streams(out, m)
    _the_ranks(out, m)
    return out.families


class _Out:
    """The families of one scrape, as they are added: a gauge or a counter of one number, or
    of {label value: number} under `label`; values that are not numbers are left out."""

    def __init__(self) -> None:
        self.families: list = []

    def _add(self, counter: bool, name: str, doc: str, values: Any, label: str | None) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kind = CounterMetricFamily if counter else GaugeMetricFamily
        f = kind(f"tokenmill_{name}", doc, labels=[label] if label else None)
        if label:
            for key, v in (values if isinstance(values, dict) else {}).items():
                if (x := _number(v)) is not None:
                    f.add_metric([str(key)], x)
        elif (x := _number(values)) is not None:
            f.add_metric([], x)
        self.families.append(f)

    def gauge(self, name: str, doc: str, values: Any, label: str | None = None) -> None:
        self._add(False, name, doc, values, label)

    def counter(self, name: str, doc: str, values: Any, label: str | None = None) -> None:
        self._add(True, name, doc, values, label)


def _the_run(out: _Out, m: dict, st: dict) -> None:
    """Rates, the stall, the step and packing, the trainers' data wait, the autoscaler."""
    out.gauge("tokens_per_second", "Packed real tokens per second (30 s window)",
              m.get("tokens_per_s"))  # fmt: skip
    out.gauge("batches_per_second", "Global steps per second (30 s window)",
              m.get("batches_per_s"))  # fmt: skip
    out.gauge("consumed_tokens_per_second", "Real tokens the ranks train on per second (their "
              "beats, 60 s window)", m.get("consumed_tokens_per_s"))  # fmt: skip
    out.gauge("rank_waiting_seconds", "How long each rank waiting now for a step not made yet "
              "has waited (measured by the service, as it happens)", m.get("ranks_waiting_s"),
              "rank")  # fmt: skip
    out.gauge("stalled", "1 while a rank has waited for data for 5 s or more",
              1.0 if m.get("stall") else 0.0)  # fmt: skip
    out.gauge("global_step", "Global steps produced (moves back on a resume)",
              m.get("global_step"))  # fmt: skip
    out.gauge("packing_efficiency", "Real tokens / (rows x seq_len)", m.get("packing_efficiency"))
    out.gauge("data_wait_seconds_last_60s", "Data wait reported by trainers, last 60 s",
              m.get("data_wait_s_last_60s"))  # fmt: skip
    out.gauge("up", "1 while running", 1.0 if st.get("state") in ("running", "paused") else 0.0)
    scale = st.get("autoscale")
    if isinstance(scale, dict):
        out.gauge("autoscale_requested_cpus", "CPUs the service asks the cluster's autoscaler "
                  "for while ranks wait for data (service.autoscale; 0: no request)",
                  scale.get("requested_cpus"))  # fmt: skip
        seen = scale.get("cluster") or {}
        out.gauge("cluster_nodes", "Live nodes of the cluster (service.autoscale looks each "
                  "tick)", seen.get("nodes"))  # fmt: skip
        out.gauge("cluster_cpus", "CPUs of the cluster (service.autoscale looks each tick)",
                  seen.get("cpus"))  # fmt: skip


def _the_producer(out: _Out, m: dict, st: dict) -> None:
    """What the producer does now, its window, and its totals."""
    producer = m.get("producer", st.get("producer"))
    if isinstance(producer, str):
        states = PRODUCER_STATES if producer in PRODUCER_STATES else (*PRODUCER_STATES, producer)
        out.gauge("producer_state",
                  "1 for what the producer does now, else 0: starting, making (steps), "
                  "window_full (waiting for the ranks to consume: normal when the trainer is "
                  "slower than the data plane), paused, ended (the data), failed, stopping, "
                  "waiting_for_loss (the mixing policy waits for the ranks' loss of a window)",
                  {s: float(s == producer) for s in states}, "state")  # fmt: skip
    out.gauge("prefetch_window_steps", "Global steps the producer may run ahead",
              m.get("prefetch"))  # fmt: skip
    out.gauge("held_steps", "Global steps held for the ranks", m.get("held_steps"))


def _the_lanes(out: _Out, m: dict) -> None:
    """Each lane's held steps, making time and restarts (lanes > 1), and the producer's wait on
    them; then the lag bound and the run's totals."""
    lanes = m.get("lanes")
    if isinstance(lanes, list):
        lanes = [d for d in lanes if isinstance(d, dict)]
        out.gauge("lane_held_steps", "Steps a lane holds for the ranks (lanes > 1): the "
                  "window's, those not yet released, and those made ahead",
                  {d.get("lane"): d.get("held_steps") for d in lanes}, "lane")  # fmt: skip
        out.counter("lane_making_seconds", "Seconds a lane spent making steps (lanes > 1, "
                    "holding): near the run's time, that lane is the one every step waits for",
                    {d.get("lane"): d.get("making_s") for d in lanes}, "lane")  # fmt: skip
        out.counter("lane_restarts", "Times a lane's actor was started again after its "
                    "process died (service.lane_restarts)",
                    {d.get("lane"): d.get("restarts") for d in lanes}, "lane")  # fmt: skip
        out.counter("lane_making_cpu_seconds", "CPU seconds of a lane's making thread",
                    {d.get("lane"): d.get("making_cpu_s") for d in lanes}, "lane")  # fmt: skip
        out.counter("lanes_waited_seconds", "Seconds the producer waited for the lanes' answers",
                    m.get("lanes_waited_s"))  # fmt: skip
        out.gauge("lanes_chunks_ahead", "Chunks of steps asked of the lanes ahead of the one "
                  "joined: more while the producer waits on lanes that have cores of their own",
                  m.get("lanes_chunks_ahead"))  # fmt: skip
    out.gauge("lag_normal_max_steps", "Top of a rank's normal lag: the prefetch window plus one "
              "fetch", m.get("lag_normal_max"))  # fmt: skip
    out.counter("tokens", "Packed real tokens produced", m.get("real_tokens"))
    out.counter("rows", "Packed rows produced", m.get("rows"))
    out.counter("rejects", "Bad records skipped, all streams", m.get("rejects") or 0)


def _the_streams(out: _Out, m: dict) -> None:
    """Per stream: what pipeline/state/summary.py declares, its loss, and tokens by backend."""
    streams = m.get("streams")
    streams = streams if isinstance(streams, dict) else {}
    for key, doc in stream_gauges():
        values = {n: s.get(key) for n, s in streams.items() if isinstance(s, dict)}
        add = out.counter if key in STREAM_COUNTERS else out.gauge
        add(f"stream_{key}", doc, values, "stream")
    loss = m.get("stream_loss")
    loss_streams = loss.get("streams") if isinstance(loss, dict) else None
    if isinstance(loss_streams, dict):
        out.gauge("stream_loss", "Token-weighted mean training loss per stream over the last "
                  "complete steps, as the ranks report it (trainer.feed.stream_loss)",
                  {n: v.get("loss") for n, v in loss_streams.items() if isinstance(v, dict)},
                  "stream")  # fmt: skip
    out.counter("tokenizer_backend_tokens", "Tokens read, by the tokenizer backend that encoded "
                "them", m.get("tokenizer_backend"), "backend")  # fmt: skip


# Per rank: metric -> (its key in a rank's view, what it means)
PER_RANK = {
    "rank_lag_steps": ("lag", "Steps the rank has consumed behind the producer"),
    "rank_consumed_step": ("consumed_step", "The next step the rank trains on (its report)"),
    "rank_fetched_step": ("fetched_step", "The first step the rank has not fetched"),
    "rank_buffered_steps": ("buffered", "Steps the rank has fetched and not consumed"),
    "rank_last_sign_of_life_seconds": ("last_sign_s_ago",
                                       "Seconds since the rank's last call or heartbeat"),
    "rank_data_wait_seconds_last_60s": ("wait_s_last_60s",
                                        "Data wait reported by the rank, last 60 s"),
    "rank_ended": ("ended", "1 once the rank was told the data has ended, else 0"),
    "rank_lost": ("lost", "1 when the rank gave no sign of life for rank_timeout_s, else 0"),
}  # fmt: skip
# Keys a server of an earlier release named otherwise in its rank view
EARLIER_KEYS = {"fetched_step": "next_step", "last_sign_s_ago": "seen_s_ago"}


def _the_ranks(out: _Out, m: dict) -> None:
    """Per rank: the steps it has not taken, and its view (`PER_RANK`)."""
    out.gauge("rank_queue_depth", "Produced steps a rank has not taken", m.get("queue_depth"),
              "rank")  # fmt: skip
    ranks = m.get("ranks")
    ranks = ranks if isinstance(ranks, dict) else {}
    ranks = {str(k): r for k, r in ranks.items() if isinstance(r, dict)}
    for metric, (key, doc) in PER_RANK.items():
        values = {k: r.get(key, r.get(EARLIER_KEYS.get(key, key))) for k, r in ranks.items()}
        out.gauge(metric, doc, values, "rank")


def _number(v: Any) -> float | None:
    """A metric value as a float (bools as 0/1); None for anything else."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    return None


class _Families:
    """A collector of ready metric families (one scrape's worth)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        yield from self.families
