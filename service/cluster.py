"""Connecting to Ray: an existing cluster (`--address`), or an embedded local one."""

from __future__ import annotations

import os

NAMESPACE = "tokenmill"
# Every Ray worker runs one tokenizer thread: Ray already runs one worker per core, and a
# rayon pool per worker would oversubscribe the cores.
WORKER_ENV = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def connect(
    address: str | None = None, object_store_memory: int | None = None, num_cpus: int | None = None
):
    """Start or join Ray once per process. Returns True if this call started a local cluster."""
    import ray

    if ray.is_initialized():
        return False
    # Under `ray job submit` the job supervisor sets RAY_ADDRESS: join that cluster.
    address = address or os.environ.get("TOKENMILL_RAY_ADDRESS") or os.environ.get("RAY_ADDRESS")
    kwargs = dict(
        namespace=NAMESPACE,
        runtime_env={"env_vars": dict(WORKER_ENV)},
        log_to_driver=os.environ.get("TOKENMILL_RAY_LOGS", "0") == "1",
        configure_logging=False,
    )
    if address:
        ray.init(address=address, **kwargs)
        return False
    if object_store_memory is None:
        object_store_memory = int(os.environ.get("TOKENMILL_OBJECT_STORE_BYTES", 1 << 30))
    ray.init(
        num_cpus=num_cpus or os.cpu_count(),
        object_store_memory=object_store_memory,
        include_dashboard=False,
        **kwargs,
    )
    return True
