"""A persistent local cluster for tests and notebooks: N worker processes on gloo, started once.

Starting processes per test costs seconds on a small machine; a pooled run costs milliseconds. Each worker
joins one gloo world when it starts and then runs whatever function it is sent, on every rank::

    from wf_mesh.testing import run_distributed

    def check_groups(tp):                      # module-level, so the workers can import it
        wf_mesh.initialize_model_parallel(tp_size=tp)
        return wf_mesh.parallel_state.get_tp_rank()

    assert run_distributed(4, check_groups, 2) == [0, 1, 0, 1]   # one result per rank

Before every function a worker seeds torch's and Python's RNGs with 0; after it, the worker destroys the
model-parallel state and every process group other than the default one, so tests do not leak into each
other. Errors:

- A function that raises on any rank re-raises, in the caller, the exception of the rank that raised FIRST
  (same type and message, the remote traceback chained as its cause), also when its peers are stuck in a
  collective: once a rank has raised, the others get :data:`ERROR_GRACE` seconds, then the cluster is aborted
  (restarted on the next call). ``return_exceptions=True`` returns every rank's exception object in place of
  its result instead (stuck ranks get a :class:`TimeoutError`).
- A rank that hangs past the timeout or dies takes the cluster down; the next call starts a fresh one.
- A function the workers cannot import (a lambda, a nested function, one defined in an interactive
  ``__main__`` or a notebook) is refused before anything is sent, with what to do instead.

Workers are forked from a server process that has already imported torch and the distributed modules tests
use (``forkserver``, :data:`PRELOAD`), so a cluster of 8 starts in a fraction of a second after the first one,
and each worker's startup objects are frozen out of the garbage collector (``gc.freeze``), so the clean-up
after every function stays cheap.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import random
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "LocalCluster",
    "RemoteTraceback",
    "c10d_ops",
    "counting_backend",
    "destroy_subgroups",
    "dispatched",
    "get_cluster",
    "graph_breaks",
    "injected_fault",
    "host_syncs",
    "process_group_counts",
    "run_distributed",
    "shutdown_clusters",
]

DEFAULT_TIMEOUT = 120.0
"""Seconds a function may run on the cluster before the call fails and the cluster is restarted."""

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
"""Timeout of the workers' gloo collectives: a rank stuck in a collective fails instead of hanging."""

ERROR_GRACE = 5.0
"""Seconds the other ranks get to finish once one rank has raised, before the cluster is aborted."""

CLEANUP_TIMEOUT = 30.0
"""Seconds the workers get to clean up (barrier, destroy groups) after a function returned on every rank."""

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.debug",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "wf_mesh.mesh",
    "wf_mesh.context_parallel",
    "wf_mesh.attention",
    "wf_mesh.ema",
    "wf_mesh.state_sync",
    "wf_mesh.pipeline",
)
"""Modules the fork server imports once, so that every worker starts with them (seconds of import each). Native
modules only: a worker loads the legacy layer (and loguru) when a function it runs needs them."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a worker, chained as the re-raised exception's cause."""

    def __init__(self, rank: int, tb: str) -> None:
        super().__init__(f"on rank {rank}:\n{tb}")
        self.rank = rank


def _worker(rank: int, world_size: int, host: str, port: int, conn: Connection) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=host,
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    gc.freeze()  # what exists now lives as long as the worker: the clean-up's gc.collect() skips it
    conn.send(("ready", rank))
    runs = 0
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        except Exception as exc:
            message = ("unpicklable", exc)
        if message is None:
            break
        runs += 1
        conn.send(_call(message))
        try:
            _store_barrier(store, f"run{runs}", world_size)
            _cleanup()
            conn.send(("clean",))
        except Exception:
            conn.send(("unclean", traceback.format_exc()))
            break
    dist.destroy_process_group()


def _call(message: tuple) -> tuple:
    """Run one function; ``("ok", result)`` or ``("error", exception, traceback text, time it was raised)``."""
    if message[0] == "unpicklable":
        exc = message[1]
        error = TypeError(f"the worker could not load the function: {type(exc).__name__}: {exc}; {_IMPORTABLE}")
        return ("error", error, "", time.time())
    fn, args, kwargs = message
    torch.manual_seed(0)
    random.seed(0)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        return ("error", _picklable(exc), traceback.format_exc(), time.time())
    try:  # the pickler the pipe uses: torch's reductions refuse e.g. a non-leaf tensor that requires grad
        ForkingPickler.dumps(result)
    except Exception as exc:
        error = TypeError(f"the result of {getattr(fn, '__name__', fn)} is not picklable: {exc}")
        return ("error", error, "", time.time())
    return ("ok", result)


_IMPORTABLE = (
    "functions sent to the cluster must be importable by the workers: define them at module level in a .py "
    "file (a script run with `python script.py` works if its top-level code is guarded by "
    "`if __name__ == '__main__':`), not as a lambda, a nested function, or in a notebook / interactive session"
)


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
    """Leave the worker as it started: no mesh, no subgroups, no state of an upper layer (its registered
    extensions reset), only the default group."""
    from wf_mesh import mesh

    current = mesh.parallel_mesh_or_none()
    if current is not None:
        current.destroy()
    else:
        mesh.reset_extensions()
    destroy_subgroups()
    gc.collect()


def _check_importable(fn: Callable[..., Any]) -> None:
    """TypeError, before anything is sent, for a function the workers cannot import."""
    name = getattr(fn, "__qualname__", repr(fn))
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(f"{name} is defined in an interactive __main__ (no file); {_IMPORTABLE}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(f"{name} cannot be sent to the workers ({type(exc).__name__}: {exc}); {_IMPORTABLE}") from None


class LocalCluster:
    """``world_size`` worker processes joined in one gloo world (see the module docstring)."""

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._store: dist.TCPStore | None = None

    @property
    def alive(self) -> bool:
        """Whether every worker process is running."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> LocalCluster:
        """Start the workers and wait until all of them have joined the gloo world."""
        self.shutdown()
        # The store server lives in this process on a free port, so there is no port race between workers.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
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
        replies = self._collect(self.timeout, "start", None)
        for rank, reply in enumerate(replies):
            if reply is None or reply[0] != "ready":
                self.shutdown(force=True)
                raise RuntimeError(f"worker {rank} of {self.world_size} failed to start: {reply}")
        return self

    def shutdown(self, force: bool = False) -> None:
        """Stop every worker: politely (they finish the current function), or at once with ``force``."""
        if not force:
            for conn in self._conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self._procs:
            if force:
                proc.kill()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be importable by the workers (a module-level function). If any rank raised, re-raise the
        exception of the rank that raised first, or, with ``return_exceptions=True``, return each rank's
        exception in place of its result.

        Returns:
            The per-rank results, in rank order.

        Raises:
            TimeoutError: no rank raised and one did not finish in ``timeout`` seconds (default: the
                cluster's).
            RuntimeError: a worker died.
        """
        _check_importable(fn)
        if not self.alive:
            self.start()
        what = getattr(fn, "__name__", repr(fn))
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        replies = self._collect(timeout or self.timeout, what, ERROR_GRACE)
        unclean_note = None
        if any(r is None for r in replies):
            self.shutdown(force=True)  # stopped after a peer raised, or dead: restart on the next call
        else:
            clean = self._collect(CLEANUP_TIMEOUT, f"clean-up after {what}", None)
            unclean = [(rank, r) for rank, r in enumerate(clean) if r is None or r[0] != "clean"]
            if unclean:
                self.shutdown(force=True)
                rank, reply = unclean[0]
                unclean_note = (
                    f"rank {rank} of {self.world_size} failed to clean up after {what} (the cluster will restart on "
                    f"the next call):\n{reply[1] if reply else 'no reply'}"
                )
        errors = sorted(
            ((r[3], rank) for rank, r in enumerate(replies) if r is not None and r[0] == "error")
        )  # by the time each rank raised
        raised = [rank for _, rank in errors]
        outcomes: list[Any] = []
        for rank, reply in enumerate(replies):
            if reply is None:
                outcomes.append(
                    TimeoutError(
                        f"rank {rank} of {self.world_size} did not finish {what}: it was still running when "
                        f"rank(s) {raised} had raised {ERROR_GRACE:g} s earlier, so the cluster was stopped"
                    )
                )
            elif reply[0] == "error":
                _, exc, tb, _ = reply
                if hasattr(exc, "add_note"):
                    exc.add_note(f"(raised on rank {rank} of {self.world_size}; ranks that raised: {sorted(raised)})")
                exc.__cause__ = RemoteTraceback(rank, tb) if tb else None
                outcomes.append(exc)
            else:
                outcomes.append(reply[1])
        if unclean_note is not None:
            if not errors:
                raise RuntimeError(unclean_note)
            for _, rank in errors:  # the function's own error stays the one raised; the clean-up's is noted
                exc = outcomes[rank]
                if hasattr(exc, "add_note"):
                    exc.add_note(f"then {unclean_note}")
        if return_exceptions or not errors:
            return outcomes
        raise outcomes[errors[0][1]]

    def _collect(self, timeout: float, what: str, grace: float | None) -> list[Any]:
        """Collect the ranks' replies. Once a rank has sent an error, the others get ``grace`` seconds; those
        still running then are stopped and left None.

        Returns:
            One reply per rank (None where none came).

        Raises:
            TimeoutError: (without an error reply) a hang; the cluster stops (restarted on the next call).
            RuntimeError: (without an error reply) a dead worker; the cluster stops likewise.
        """
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
                    if any(r is not None and r[0] == "error" for r in replies):
                        continue  # the rank that raised explains more than the one that died after it
                    self.shutdown(force=True)
                    raise RuntimeError(
                        f"rank {rank} of {self.world_size} died during {what} (exit code {code}); "
                        "the cluster will restart on the next call"
                    ) from None
                if grace is not None and replies[rank][0] == "error":  # others may be stuck in a collective
                    deadline = min(deadline, time.monotonic() + grace)
        if pending:
            self.shutdown(force=True)
            if any(r is not None and r[0] == "error" for r in replies):
                return replies
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


def run_distributed(
    world_size: int, fn: Callable[..., Any], *args: Any, return_exceptions: bool = False, **kwargs: Any
) -> list[Any]:
    """Run ``fn`` on every rank of the shared ``world_size`` cluster (see :meth:`LocalCluster.run`).

    Returns:
        The per-rank results in rank order; with ``return_exceptions=True`` a rank that raised gives its
        exception object instead of a result.
    """
    return get_cluster(world_size).run(fn, *args, return_exceptions=return_exceptions, **kwargs)


def shutdown_clusters() -> None:
    """Stop every shared cluster (also registered to run at interpreter exit)."""
    for cluster in _clusters.values():
        cluster.shutdown()
    _clusters.clear()


atexit.register(shutdown_clusters)


# ---- observing process groups and c10d ops (tests and benchmarks) ---------------------------------------
def process_group_counts() -> tuple[int, int]:
    """Count the process groups this rank holds and the ``new_group`` calls this process made.

    Non-member ``new_group`` calls create no group on this rank but still advance torch's group counter.

    Returns:
        ``(process groups this rank holds, new_group calls made so far in this process)``.
    """
    from wf_mesh import _compat

    return len(_compat.process_groups()), _compat.new_group_calls()


def injected_fault(where: str, at: int, exc: Exception) -> Any:
    """A context manager in which this process's local step ``(where, at)`` of any contained sequence raises
    ``exc`` (see :func:`wf_mesh.faults.injected_fault`), for testing failure handling.

    Returns:
        The context manager.
    """
    from wf_mesh import faults

    return faults.injected_fault(where, at, exc)


def destroy_subgroups() -> None:
    """Destroy every process group except the default one (the clean-up between tests), and DTensor's caches
    (meshes built outside wf_mesh, with ``init_device_mesh``, lost their groups too)."""
    from wf_mesh import _compat

    if not dist.is_initialized():
        return
    default = dist.group.WORLD
    for pg in _compat.process_groups():
        if pg is not default:
            dist.destroy_process_group(pg)
    _compat.clear_dtensor_caches()


def c10d_ops(on_op: Callable[[str, tuple], None]) -> Any:
    """A context manager in which ``on_op(name, args)`` sees every ``c10d`` op dispatched on this thread (and in
    autograd's backward), collectives and point-to-point alike, before it runs.

    CommDebugMode counts collectives only; this counts ``send`` / ``recv_`` too.

    Args:
        on_op: called with the op's name (``"send"``, ``"recv_"``, ``"alltoall_base_"``,
            ``"_allgather_base_"``, ...) and its arguments.

    Returns:
        The dispatch mode, to use in a ``with`` statement.
    """
    from wf_mesh import _compat

    class C10dOps(_compat.dispatch_mode()):  # type: ignore[misc]  # torch's base class, found at run time
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                on_op(str(func).split(".")[1], args)
            return func(*args, **(kwargs or {}))

    return C10dOps()


HOST_SYNC_OPS = ("_local_scalar_dense",)
"""aten ops that hand a tensor's value to the host (``.item()``, ``bool(t)``, ``int(t)``): a device-to-host sync."""


def host_syncs(on_sync: Callable[[str], None]) -> Any:
    """A context manager in which ``on_sync(what)`` sees every host sync dispatched on this thread (and in
    autograd's backward): ``.item()`` / ``bool()`` of a tensor (``aten._local_scalar_dense``) and copies from a
    non-CPU device to the CPU. ``.tolist()`` is not dispatched: count the collectives it would follow
    (:func:`c10d_ops`) to see an agreement exchange.

    Args:
        on_sync: called with the op's name (``"_local_scalar_dense"``, ``"_to_copy cuda->cpu"``, ...).

    Returns:
        The dispatch mode, to use in a ``with`` statement.
    """
    from wf_mesh import _compat

    def to_host(func, args, kwargs) -> bool:
        name = func.__name__.split(".")[0]
        if name == "_to_copy":
            device = kwargs.get("device")
            return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
        if name == "copy_":
            return args[0].device.type == "cpu" and args[1].device.type != "cpu"
        return False

    class HostSyncs(_compat.dispatch_mode()):  # type: ignore[misc]  # torch's base class, found at run time
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.__name__.split(".")[0]
            if name in HOST_SYNC_OPS:
                on_sync(name)
            elif to_host(func, args, kwargs):
                on_sync(f"{name} {args[-1].device.type if name == 'copy_' else args[0].device.type}->cpu")
            return func(*args, **kwargs)

    return HostSyncs()


def counting_backend(inner: str = "aot_eager") -> tuple[Callable[..., Any], list[int]]:
    """``(backend, compiles)``: a ``torch.compile`` backend that delegates to the registered backend ``inner``
    and appends the number of nodes of every graph it compiles to ``compiles`` (one entry per graph: graph
    breaks and recompiles both add one).

    Args:
        inner: the backend that compiles (``"aot_eager"``: AOTAutograd with fake tensors, eager kernels;
            ``"inductor"``: the default).

    Returns:
        The backend and the list it fills.
    """
    from wf_mesh import _compat

    compile_graph = _compat.compile_backend(inner)
    compiles: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiles.append(len(gm.graph.nodes))
        return compile_graph(gm, example_inputs)

    return backend, compiles


def dispatched(on_outputs: Callable[[list[torch.Tensor]], None]) -> Any:
    """A context manager in which ``on_outputs(tensors)`` sees the tensor outputs of every op dispatched on this
    thread (and in autograd's backward), after it ran (e.g. to track the live bytes a call allocates).

    Args:
        on_outputs: called with each op's output tensors.

    Returns:
        The dispatch mode, to use in a ``with`` statement.
    """
    from wf_mesh import _compat

    class Outputs(_compat.dispatch_mode()):  # type: ignore[misc]  # torch's base class, found at run time
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            flat = result if isinstance(result, (tuple, list)) else [result]
            on_outputs([t for t in flat if isinstance(t, torch.Tensor)])
            return result

    return Outputs()


def graph_breaks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, int, list[str]]:
    """How dynamo captures ``fn(*args, **kwargs)`` (``torch._dynamo.explain``, nothing compiled).

    Args:
        fn: the function to trace.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        ``(graphs, graph breaks, the reasons of the breaks)``.
    """
    from wf_mesh import _compat

    return _compat.graph_breaks(fn, *args, **kwargs)
