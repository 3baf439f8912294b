"""The distributed engine that does the data work: Ray.

Why Ray, against the alternatives the field uses:
- Ray core tasks map a function over work units on one machine or many with the same code: `ray.init()` starts
  a local instance inside the stage (nothing to start by hand), `ray.init(address=...)` joins a cluster that
  spans many nodes. It is what Ray Data, datatrove's RayPipelineExecutor and OpenRLHF build on, so a team that
  trains with them already runs it.
- datatrove's executors would bring their own document model, reader and tokenizer steps, loguru logging
  folders and completion files; our units, normalisers (bad rows named by file and line) and shard format would
  have to be rewritten as datatrove pipeline steps to gain a scheduler we need only the core of.
- Ray Data streams rows between operators, but our work is per unit and writes files of its own; its
  operators' ordering and block sizing would stand between a unit and its shard file.
- Dask (distributed) does the same task mapping, but is less used for LLM data work, and its scheduler
  process is one more thing to run on a cluster.

`engine(address, workers, units)` yields a `map_units(fn, items, *shared)` that runs `fn(item, *shared)` for every
item as Ray tasks, at most a bounded number in flight, and yields `(index, result)` as they finish. An error a
task raises for the user (bad data) comes back as itself; an unreachable cluster address is one error naming
`tokenizer.cluster`, not a hang. Work of a single unit, with no cluster named, runs in this process: there is
nothing to spread, and a local Ray instance would add its start-up (about 6 s here) for nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gptforge.core.errors import UserError, storage_error

ENV = {"TOKENIZERS_PARALLELISM": "false"}  # one core a task: no thread pools inside tasks


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A clear error, not a hang, for a cluster address nobody answers at."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as e:
        raise UserError(f"tokenizer.cluster={address}: cannot reach a Ray cluster there ({e}); start one "
                        "(`ray start --head`) or set tokenizer.cluster to null for a local instance") from None


@contextmanager
def engine(address: str | None, workers: int, units: int):
    """A Ray instance for the block: a local one with `workers` CPUs, or the cluster at `address` (or this process
    alone for a single unit and no cluster)."""
    if address is None and units <= 1:
        yield in_process
        return
    with ray_instance(address, workers):
        yield map_units


@contextmanager
def ray_instance(address: str | None, workers: int):
    """Ray, initialised for the block: a local instance with `workers` CPUs on 127.0.0.1, or the cluster at
    `address` (`tokenizer.cluster`)."""
    import ray
    from ray._private import ray_constants

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry (and no network here)
    if address is None:
        # A local instance listens on 127.0.0.1 alone. Ray binds its servers (GCS, raylet and object manager,
        # workers, the runtime-env agent, the autoscaler's metrics) to loopback only where the node's address is
        # loopback, and takes the node's address for 127.0.0.1 only with ENABLE_RAY_CLUSTER off (what
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 sets at import; _private/services.py: resolve_ip_for_localhost).
        # Otherwise everything listens on every interface of the host.
        # Its workers get ENV as the raylet's children, which inherit this process's environment: a job-wide
        # runtime_env would have the raylet start a second set of workers for it, besides those it starts at once
        # (a second of each worker's CPU, and a second more before the first task runs).
        cluster, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
        saved = {k: os.environ.get(k) for k in ENV}
        os.environ.update(ENV)
        try:
            ray.init(address="local", num_cpus=workers, include_dashboard=False, configure_logging=False,
                     object_store_memory=256 << 20)
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = cluster
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    else:
        check_reachable(address)
        ray.init(address=address, configure_logging=False, runtime_env={"env_vars": ENV})
    try:
        yield
    finally:
        ray.shutdown()


def in_process(fn: Callable, items: list, *shared) -> Iterator[tuple[int, object]]:
    for i, item in enumerate(items):
        yield i, fn(item, *shared)


def map_units(fn: Callable, items: list, *shared, in_flight: int | None = None) -> Iterator[tuple[int, object]]:
    """`fn(item, *shared)` for every item as Ray tasks; yields (index, result) as each finishes."""
    import ray

    remote = ray.remote(num_cpus=1, max_retries=2)(fn)
    shared = [ray.put(s) for s in shared]  # stored once, not once a task
    limit = in_flight or max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    pending: dict = {}
    todo = iter(enumerate(items))
    while True:
        for i, item in todo:
            pending[remote.remote(item, *shared)] = i
            if len(pending) >= limit:
                break
        if not pending:
            return
        (done,), _ = ray.wait(list(pending), num_returns=1)
        try:
            yield pending.pop(done), ray.get(done)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, UserError):
                raise e.cause from None
            if isinstance(e.cause, OSError) and storage_error(e.cause):
                raise storage_error(e.cause) from None
            raise
