"""A persistent local cluster for tests and notebooks: N worker processes on gloo, started once.

Spawning processes per test costs seconds on a small machine; a pooled run costs milliseconds. Each
worker joins one gloo world when it starts and then runs whatever function it is sent, on every rank::

    from wf_mesh.testing import run_distributed

    def check_groups(tp):                      # module-level, so the workers can import it
        wf_mesh.initialize_model_parallel(tp_size=tp)
        return wf_mesh.parallel_state.get_tp_rank()

    assert run_distributed(4, check_groups, 2) == [0, 1, 0, 1]   # one result per rank

After every function a worker destroys the model-parallel state and any process group other than the
default one, so tests do not leak into each other. A function that raises on any rank re-raises the
lowest rank's exception in the caller (same type, the remote traceback chained as its cause). A rank that
hangs past the timeout or dies takes the cluster down; the next call starts a fresh one.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LocalCluster", "RemoteTraceback", "get_cluster", "run_distributed", "shutdown_clusters"]

DEFAULT_TIMEOUT = 120.0
"""Seconds a function may run on the cluster before the call fails and the cluster is restarted."""

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
"""Timeout of the workers' gloo collectives: a rank stuck in a collective fails instead of hanging."""

ERROR_GRACE = 10.0
"""Seconds to wait for the other ranks once one rank has raised, before restarting the cluster."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a worker, chained as the re-raised exception's cause."""

    def __init__(self, rank: int, tb: str) -> None:
        super().__init__(f"on rank {rank}:\n{tb}")
        self.rank = rank


def _worker(rank: int, world_size: int, host: str, port: int, conn: Connection) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=host, MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    conn.send(("ready", rank))
    runs = 0
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
            reply = ("error", _picklable(exc), traceback.format_exc())
        runs += 1
        _store_barrier(store, f"run{runs}", world_size)
        _cleanup()
        try:
            conn.send(reply)
        except Exception as exc:  # the result itself would not pickle
            conn.send(("error", TypeError(f"result of {fn.__name__} is not picklable: {exc}"), ""))
    dist.destroy_process_group()


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _store_barrier(store: dist.Store, key: str, world_size: int) -> None:
    """Wait until every rank got here, through the store: no process group is involved, so it can never be
    matched against a collective a test left pending, and a rank's in-flight sends are received before its
    peers tear their groups down."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"])


def _cleanup() -> None:
    """Leave the worker as it started: no mesh, no subgroups, only the default group."""
    from wf_mesh import _compat, parallel_state

    parallel_state.destroy_model_parallel()
    _compat.destroy_subgroups()
    gc.collect()


class LocalCluster:
    """``world_size`` spawned worker processes joined in one gloo world (see the module docstring)."""

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._store: dist.TCPStore | None = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> LocalCluster:
        """Start the workers and wait until all of them have joined the gloo world."""
        self.shutdown()
        # The store server lives in this process on a free port, so there is no port race between workers.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, "127.0.0.1", self._store.port, child),
                name=f"wf_mesh-worker-{rank}/{self.world_size}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        replies = self._collect(self.timeout, "start")
        for rank, reply in enumerate(replies):
            if reply[0] != "ready":
                self.shutdown()
                raise RuntimeError(f"worker {rank} failed to start: {reply}")
        return self

    def shutdown(self, force: bool = False) -> None:
        """Stop every worker: politely (they finish the current function), or at once with ``force``."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be importable by the workers (a module-level function). Raises the lowest rank's
        exception if any rank raised; TimeoutError if a rank did not finish in ``timeout`` seconds.
        """
        if not self.alive:
            self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = self._collect(timeout or self.timeout, getattr(fn, "__name__", repr(fn)))
        errors = [(rank, r) for rank, r in enumerate(replies) if r is not None and r[0] == "error"]
        if errors:
            rank, (_, exc, tb) = errors[0]
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on rank {rank} of {self.world_size}; ranks that raised: {[r for r, _ in errors]})")
            raise exc from RemoteTraceback(rank, tb)
        return [r[1] for r in replies]

    def _collect(self, timeout: float, what: str) -> list[Any]:
        """Wait for one reply per rank. On a hang or a dead worker, restart-on-next-use and raise."""
        replies: list[Any] = [None] * self.world_size
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    replies[rank] = pending.pop(rank).recv()
                except EOFError:
                    self._procs[rank].join(timeout=5)
                    code = self._procs[rank].exitcode
                    self.shutdown(force=True)
                    raise RuntimeError(
                        f"rank {rank} of {self.world_size} died during {what} (exit code {code}); "
                        "the cluster will restart on the next call"
                    ) from None
                if replies[rank][0] == "error":  # others may be stuck in a collective with it
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE)
        if pending:
            self.shutdown(force=True)
            if any(r is not None and r[0] == "error" for r in replies):
                return replies  # the caller raises the real error
            raise TimeoutError(
                f"ranks {sorted(pending)} of {self.world_size} did not finish {what} within {timeout:.0f}s; "
                "the cluster was stopped and will restart on the next call"
            )
        return replies


_clusters: dict[int, LocalCluster] = {}


def get_cluster(world_size: int) -> LocalCluster:
    """The process-wide cluster of ``world_size`` ranks, started on first use."""
    if world_size not in _clusters:
        _clusters[world_size] = LocalCluster(world_size)
    return _clusters[world_size]


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn`` on every rank of the shared ``world_size`` cluster; per-rank results in rank order."""
    return get_cluster(world_size).run(fn, *args, **kwargs)


def shutdown_clusters() -> None:
    """Stop every shared cluster (also registered to run at interpreter exit)."""
    for cluster in _clusters.values():
        cluster.shutdown()
    _clusters.clear()


atexit.register(shutdown_clusters)
