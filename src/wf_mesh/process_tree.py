"""Launch a tree of processes and stop all of it: what ``wf-mesh demo`` and ``benchmarks/run.py`` use.

:class:`ProcessTree` marks every process it starts (and their descendants, through the environment) so that it
can stop the whole tree, also workers that torchrun puts in sessions of their own: SIGTERM first, SIGKILL after
a grace period. :func:`interruptible` turns SIGINT / SIGTERM into :class:`Interrupted` for a block, so the caller
can print one line and exit with 130 / 143 instead of every rank's traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

__all__ = ["Interrupted", "ProcessTree", "interruptible"]

TREE_ENV = "WF_MESH_PROCESS_TREE"
"""Environment variable that marks every process of a :class:`ProcessTree` (a unique id per tree)."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while :func:`interruptible` was active."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """130 for SIGINT, 143 for SIGTERM (128 + the signal number, as shells report it)."""
        return 128 + self.signum


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` in the main thread, for the duration of the block."""

    def raise_interrupted(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _proc_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _parent(pid: int) -> int | None:
    """The parent of a live process (None for zombies and processes that are gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return None
    return None if state in (b"Z", b"X") else int(ppid)


def _has_env(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


class ProcessTree:
    """A command started in a session of its own, whose every descendant can be found and stopped.

    Each process of the tree carries ``WF_MESH_PROCESS_TREE=<unique id>`` in its environment, so
    :meth:`stop` finds the workers even after their parents died or put them in sessions of their own (as
    torchrun does), and kills them: SIGTERM first, SIGKILL for whatever is left after ``grace`` seconds.

    Output: ``log`` (an open file) receives stdout and stderr; otherwise both are read line by line and passed
    to ``on_stdout`` / ``on_stderr`` (default: written to this process's stdout / stderr) until :attr:`quiet` is
    set, after which they are dropped (an interrupted run's tracebacks).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        log: IO[str] | None = None,
        on_stdout: Callable[[str], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
    ) -> None:
        self.marker = uuid.uuid4().hex
        self.quiet = False
        env = {**(os.environ if env is None else env), TREE_ENV: self.marker}
        out = log if log is not None else subprocess.PIPE
        err = subprocess.STDOUT if log is not None else subprocess.PIPE
        self.proc = subprocess.Popen(
            list(cmd),
            env=env,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._threads = []
        if log is None:
            for stream, sink in (
                (self.proc.stdout, on_stdout or _writer(sys.stdout)),
                (self.proc.stderr, on_stderr or _writer(sys.stderr)),
            ):
                thread = threading.Thread(target=self._pump, args=(stream, sink), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, stream: IO[str], sink: Callable[[str], None]) -> None:
        for line in stream:
            if not self.quiet:
                sink(line)
        stream.close()

    def members(self) -> list[int]:
        """Live processes of the tree: the marked ones and the descendants of the command."""
        entry = f"{TREE_ENV}={self.marker}".encode()
        parents = {pid: _parent(pid) for pid in _proc_pids()}
        parents = {pid: ppid for pid, ppid in parents.items() if ppid is not None and pid != os.getpid()}
        found = {pid for pid in parents if _has_env(pid, entry)}
        frontier = {self.proc.pid} if self.proc.poll() is None else set()
        while frontier:
            found |= frontier
            frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        return sorted(found)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command to exit and its output to be passed on. Processes of the tree still running
        then (orphans holding on) are stopped.

        Returns:
            The command's exit code.
        """
        code = self.proc.wait(timeout)
        if self.members():
            self.stop(grace=1.0, quiet=False)
        for thread in self._threads:
            thread.join(timeout=5.0)  # a pipe still held open elsewhere must not hang the caller
        return code

    def stop(self, grace: float = 3.0, *, quiet: bool = True) -> int:
        """Stop every process of the tree (SIGTERM, then SIGKILL after ``grace`` s).

        ``quiet``: drop the tree's output from now on (an interrupted run's tracebacks).

        Returns:
            How many processes there were.
        """
        self.quiet = self.quiet or quiet
        victims: set[int] = set()
        with _signals_ignored():  # a second Ctrl-C must not interrupt the clean-up
            for sig, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                left = self.members()
                if not left:
                    break
                victims.update(left)
                for pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    self.proc.poll()  # reap our own child
                    if not self.members():
                        break
                    time.sleep(0.05)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5.0)
            for thread in self._threads:
                thread.join(timeout=1.0)
        return len(victims)


def _writer(stream: IO[str]) -> Callable[[str], None]:
    def write(line: str) -> None:
        stream.write(line)
        stream.flush()

    return write
