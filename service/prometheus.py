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
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out: list = []

    def family(kind, name, doc, values, label=None):
        """`values`: a number, or {label value: number} with `label`; non-numbers are left out."""
        f = kind(f"tokenmill_{name}", doc, labels=[label] if label else None)
        if label:
            for key, v in (values if isinstance(values, dict) else {}).items():
                if (x := _number(v)) is not None:
                    f.add_metric([str(key)], x)
        elif (x := _number(values)) is not None:
            f.add_metric([], x)
        out.append(f)

    def gauge(name, doc, values, label=None):
        family(GaugeMetricFamily, name, doc, values, label)

    def counter(name, doc, values, label=None):
        family(CounterMetricFamily, name, doc, values, label)

    gauge("tokens_per_second", "Packed real tokens per second (30 s window)", m.get("tokens_per_s"))
    gauge("batches_per_second", "Global steps per second (30 s window)", m.get("batches_per_s"))
    gauge("consumed_tokens_per_second", "Real tokens the ranks train on per second (their "
          "beats, 60 s window)", m.get("consumed_tokens_per_s"))  # fmt: skip
    gauge("rank_waiting_seconds", "How long each rank waiting now for a step not made yet "
          "has waited (measured by the service, as it happens)", m.get("ranks_waiting_s"), "rank")  # fmt: skip
    gauge(
        "stalled",
        "1 while a rank has waited for data for 5 s or more",
        1.0 if m.get("stall") else 0.0,
    )
    gauge("global_step", "Global steps produced (moves back on a resume)", m.get("global_step"))
    gauge("packing_efficiency", "Real tokens / (rows x seq_len)", m.get("packing_efficiency"))
    gauge(
        "data_wait_seconds_last_60s",
        "Data wait reported by trainers, last 60 s",
        m.get("data_wait_s_last_60s"),
    )
    gauge("up", "1 while running", 1.0 if st.get("state") in ("running", "paused") else 0.0)
    scale = st.get("autoscale")
    if isinstance(scale, dict):
        gauge("autoscale_requested_cpus", "CPUs the service asks the cluster's autoscaler for "
              "while ranks wait for data (service.autoscale; 0: no request)",
              scale.get("requested_cpus"))  # fmt: skip
        seen = scale.get("cluster") or {}
        gauge("cluster_nodes", "Live nodes of the cluster (service.autoscale looks each tick)",
              seen.get("nodes"))  # fmt: skip
        gauge("cluster_cpus", "CPUs of the cluster (service.autoscale looks each tick)",
              seen.get("cpus"))  # fmt: skip
    producer = m.get("producer", st.get("producer"))
    if isinstance(producer, str):
        states = PRODUCER_STATES if producer in PRODUCER_STATES else (*PRODUCER_STATES, producer)
        gauge(
            "producer_state",
            "1 for what the producer does now, else 0: starting, making (steps), window_full "
            "(waiting for the ranks to consume: normal when the trainer is slower than the "
            "data plane), paused, ended (the data), failed, stopping, waiting_for_loss (the "
            "mixing policy waits for the ranks' loss of a window)",
            {s: float(s == producer) for s in states},
            "state",
        )
    gauge("prefetch_window_steps", "Global steps the producer may run ahead", m.get("prefetch"))
    gauge("held_steps", "Global steps held for the ranks", m.get("held_steps"))
    lanes = m.get("lanes")
    if isinstance(lanes, list):
        gauge("lane_held_steps", "Steps a lane holds for the ranks (lanes > 1): the window's, "
              "those not yet released, and those made ahead",
              {d.get("lane"): d.get("held_steps") for d in lanes if isinstance(d, dict)},
              "lane")  # fmt: skip
        counter("lane_making_seconds", "Seconds a lane spent making steps (lanes > 1, holding): "
                "near the run's time, that lane is the one every step waits for",
                {d.get("lane"): d.get("making_s") for d in lanes if isinstance(d, dict)},
                "lane")  # fmt: skip
        counter("lane_restarts", "Times a lane's actor was started again after its process "
                "died (service.lane_restarts)",
                {d.get("lane"): d.get("restarts") for d in lanes if isinstance(d, dict)},
                "lane")  # fmt: skip
        counter("lane_making_cpu_seconds", "CPU seconds of a lane's making thread",
                {d.get("lane"): d.get("making_cpu_s") for d in lanes if isinstance(d, dict)},
                "lane")  # fmt: skip
        counter(
            "lanes_waited_seconds",
            "Seconds the producer waited for the lanes' answers",
            m.get("lanes_waited_s"),
        )
        gauge(
            "lanes_chunks_ahead",
            "Chunks of steps asked of the lanes ahead of the one joined: more while the "
            "producer waits on lanes that have cores of their own",
            m.get("lanes_chunks_ahead"),
        )
    gauge(
        "lag_normal_max_steps",
        "Top of a rank's normal lag: the prefetch window plus one fetch",
        m.get("lag_normal_max"),
    )
    counter("tokens", "Packed real tokens produced", m.get("real_tokens"))
    counter("rows", "Packed rows produced", m.get("rows"))
    counter("rejects", "Bad records skipped, all streams", m.get("rejects") or 0)
    streams = m.get("streams")
    streams = streams if isinstance(streams, dict) else {}
    for key, doc in stream_gauges():  # pipeline/state/summary.py declares them
        values = {n: s.get(key) for n, s in streams.items() if isinstance(s, dict)}
        (counter if key in STREAM_COUNTERS else gauge)(f"stream_{key}", doc, values, "stream")
    loss = m.get("stream_loss")
    loss_streams = loss.get("streams") if isinstance(loss, dict) else None
    if isinstance(loss_streams, dict):
        gauge(
            "stream_loss",
            "Token-weighted mean training loss per stream over the last complete steps, as the "
            "ranks report it (trainer.feed.stream_loss)",
            {n: v.get("loss") for n, v in loss_streams.items() if isinstance(v, dict)},
            "stream",
        )
    counter(
        "tokenizer_backend_tokens",
        "Tokens read, by the tokenizer backend that encoded them",
        m.get("tokenizer_backend"),
        "backend",
    )
    gauge("rank_queue_depth", "Produced steps a rank has not taken", m.get("queue_depth"), "rank")
    ranks = m.get("ranks")
    ranks = {str(k): r for k, r in ranks.items() if isinstance(r, dict)} if isinstance(ranks, dict) else {}  # fmt: skip
    per_rank = {
        "rank_lag_steps": ("lag", "Steps the rank has consumed behind the producer"),
        "rank_consumed_step": ("consumed_step", "The next step the rank trains on (its report)"),
        "rank_fetched_step": ("fetched_step", "The first step the rank has not fetched"),
        "rank_buffered_steps": ("buffered", "Steps the rank has fetched and not consumed"),
        "rank_last_sign_of_life_seconds": (
            "last_sign_s_ago",
            "Seconds since the rank's last call or heartbeat",
        ),
        "rank_data_wait_seconds_last_60s": (
            "wait_s_last_60s",
            "Data wait reported by the rank, last 60 s",
        ),
        "rank_ended": ("ended", "1 once the rank was told the data has ended, else 0"),
        "rank_lost": ("lost", "1 when the rank gave no sign of life for rank_timeout_s, else 0"),
    }
    older = {"fetched_step": "next_step", "last_sign_s_ago": "seen_s_ago"}  # earlier names
    for metric, (key, doc) in per_rank.items():
        values = {k: r.get(key, r.get(older.get(key, key))) for k, r in ranks.items()}
        gauge(metric, doc, values, "rank")
    return out


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
