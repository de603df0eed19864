"""The ``wf-mesh`` command line.

Subcommands::

    wf-mesh plan --world-size 16 --tp 2 --cp 2 --pp 2 [--cfg 2] [--dp N] [--cp-ulysses N] [--order tp-cp-pp-dp]
                 [--axis AXIS] [--highlight RANK] [--max-rows N] [--max-cols N] [--html PATH]
        Print the rank grid and every axis's groups: ``str(wf_mesh.TopologyView(dims))``, the view a notebook
        renders (``--html`` writes its HTML). Pure arithmetic: no processes, no torch import, milliseconds even
        for a billion ranks (large worlds are cut, and the view says what it left out).
    wf-mesh demo --nproc 4 --tp 2 --cp 2 [--pp 1] [--cfg 1] [--cp-ulysses 1] [--order tp-cp-pp-dp]
        Launch N local CPU processes (gloo) with torch's own launcher and run :mod:`wf_mesh.demo` on them,
        showing progress while the workers start, and the whole run's time when it exits.
    wf-mesh demo --nproc 2 --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT --tp 2 --cp 2 [--rdzv-timeout S]
        The same across several machines (run it on every node; the world is nnodes x nproc ranks): torchrun's
        multi-node rendezvous (``--rdzv-backend c10d`` by default) at HOST:PORT, a host every node reaches.
        While it waits for the other nodes it says so every few seconds; it gives up after ``--rdzv-timeout``
        seconds (default :data:`DEFAULT_RDZV_TIMEOUT`).

The degree flags (``--tp --cp --pp --cfg --dp --cp-ulysses``) are generated from
:data:`wf_mesh.topology.AXIS_TABLE` by :func:`add_degree_flags`, and read back by :func:`dims_from_args`; the
demo's own parser uses the same two.

Bad input is reported as one line on stderr with exit code 2, before anything is launched (and before torch
is imported: this module never imports it). Ctrl-C / SIGTERM stop the whole process tree the demo started
(launcher, agents, workers), print one line and exit with 130 / 143.

The benchmarks are not part of the package: ``python benchmarks/run.py [--quick]`` in a source checkout; it
stops its process trees the same way (:mod:`wf_mesh.process_tree`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from wf_mesh.process_tree import Interrupted, ProcessTree, interruptible
from wf_mesh.topology import AXIS_TABLE, DEFAULT_ORDER, ParallelDims

__all__ = [
    "DEFAULT_RDZV_TIMEOUT",
    "PROGRESS_ENV",
    "STAGES",
    "add_degree_flags",
    "build_parser",
    "degree_args",
    "demo_command",
    "dims_from_args",
    "main",
]

DEFAULT_RDZV_TIMEOUT = 300.0
"""Seconds ``wf-mesh demo`` waits for a rendezvous (other nodes, or the other ranks joining the gloo world)."""

PROGRESS_ENV = "WF_MESH_DEMO_PROGRESS"
"""Environment variable naming the folder where each local demo worker records how far it got."""


HEARTBEAT = 3.0
"""Seconds between progress lines while nothing changes."""


class _UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


class _Failure(Exception):
    """A launched run that could not complete (e.g. a rendezvous timeout): printed as one line, exit code 1."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``wf-mesh plan: error: ...`` and exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---- parser -----------------------------------------------------------------------------------------------
def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value > 0 or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_degree_flags(parser: argparse.ArgumentParser) -> None:
    """Add a degree option per :data:`~wf_mesh.topology.AXIS_TABLE` row (``--tp``, ``--cp``, ``--pp``, ``--cfg``,
    ``--dp``), one per split (``--cp-ulysses``) and ``--order``; :func:`dims_from_args` reads them back.

    Args:
        parser: the parser (or subparser) to add them to.
    """
    for axis in AXIS_TABLE:
        default = "inferred" if axis.inferred else str(axis.default)
        parser.add_argument(
            axis.flag,
            dest=axis.name,
            type=int,
            default=axis.default,
            metavar="N",
            help=f"{axis.description} (default {default})",
        )
    for axis in AXIS_TABLE:
        if axis.split:
            parser.add_argument(
                axis.split.flag,
                dest=axis.split.fast,
                type=int,
                default=1,
                metavar="N",
                help=f"{axis.split.description}; shows both sub-axes (default 1)",
            )
    parser.add_argument(
        "--order",
        default=DEFAULT_ORDER,
        help=f"rank order, fastest-varying axis first (default {DEFAULT_ORDER}; an optional axis left out goes "
        "just before dp)",
    )


def dims_from_args(args: argparse.Namespace) -> ParallelDims:
    """The :class:`~wf_mesh.topology.ParallelDims` that the :func:`add_degree_flags` options of ``args`` ask for.

    Args:
        args: parsed arguments of a parser given :func:`add_degree_flags`.

    Returns:
        The dims, not resolved.

    Raises:
        TypeError, ValueError: the degrees are not valid (ParallelDims judges).
    """
    fields = [a.name for a in AXIS_TABLE] + [a.split.fast for a in AXIS_TABLE if a.split]
    return ParallelDims(order=args.order, **{name: getattr(args, name) for name in fields})


def degree_args(dims: ParallelDims) -> list[str]:
    """The :func:`add_degree_flags` options that ask for ``dims``' degrees and order (dp left to infer; an
    optional axis or a split only when it is not its default, so the arguments of a four-axis world stay as
    they were).

    Args:
        dims: the dims to pass on.

    Returns:
        Arguments such as ``["--tp", "2", "--cp", "2", "--pp", "1", "--order", "tp-cp-pp-dp"]``.
    """
    out: list[str] = []
    for axis in AXIS_TABLE:
        value = getattr(dims, axis.name)
        if not axis.inferred and (not axis.optional or value != axis.default):
            out += [axis.flag, str(value)]
    for axis in AXIS_TABLE:
        if axis.split and getattr(dims, axis.split.fast) != 1:
            out += [axis.split.flag, str(getattr(dims, axis.split.fast))]
    return [*out, "--order", dims.shown_order]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``wf-mesh`` (one subparser per subcommand)."""
    from wf_mesh import __version__

    parser = _Parser(prog="wf-mesh", description="Plan and try tp/cp/pp/dp process-group layouts.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,demo}")

    plan = sub.add_parser("plan", help="print the rank layout and groups of a world (no processes, no torch)")
    plan.add_argument("--world-size", type=int, required=True, help="number of ranks")
    add_degree_flags(plan)
    plan.add_argument("--axis", help="show this axis alone (e.g. dp_cp, tp-cp, cp_ulysses) and list its groups")
    plan.add_argument("--highlight", type=int, metavar="RANK", help="mark this rank with *")
    plan.add_argument("--max-rows", type=_positive(int), default=16, metavar="N", help="grid rows shown (16)")
    plan.add_argument("--max-cols", type=_positive(int), default=16, metavar="N", help="grid columns shown (16)")
    plan.add_argument("--html", metavar="PATH", help="also write the view as an HTML page to PATH")
    plan.set_defaults(func=_plan)

    demo = sub.add_parser("demo", help="run the mesh, CP, FSDP2 + EMA and the pipeline ring on CPU processes (gloo)")
    demo.add_argument("--nproc", type=int, required=True, help="processes per node (the world size on one node)")
    add_degree_flags(demo)
    nodes = demo.add_argument_group("several nodes (run the same command on every node)")
    nodes.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1: a standalone local run)")
    nodes.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous; c10d numbers nodes)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous address that every node reaches")
    nodes.add_argument("--rdzv-backend", choices=("c10d", "static"), default="c10d", help="default c10d")
    nodes.add_argument("--rdzv-id", default="wf-mesh-demo", help="job id, the same on every node")
    nodes.add_argument(
        "--rdzv-timeout",
        type=_positive(float),
        default=DEFAULT_RDZV_TIMEOUT,
        metavar="SECONDS",
        help=f"give up when waiting longer than this for the other nodes to join, or for the ranks to join the "
        f"gloo world (default {DEFAULT_RDZV_TIMEOUT:g})",
    )
    demo.set_defaults(func=_demo)
    return parser


def _dims(args: argparse.Namespace, world_size: int) -> ParallelDims:
    try:
        return dims_from_args(args).resolve(world_size)
    except (TypeError, ValueError) as e:
        raise _UsageError(str(e)) from None


# ---- plan -------------------------------------------------------------------------------------------------
_PAGE_HEAD = (  # color-scheme: the page itself (background, text) follows the reader's light or dark scheme
    "<!doctype html><meta charset='utf-8'><meta name='color-scheme' content='light dark'><title>wf-mesh plan</title>"
)


def _plan(args: argparse.Namespace) -> int:
    from wf_mesh.viz import TopologyView

    dims = _dims(args, args.world_size)
    try:
        view = TopologyView(dims, args.axis, highlight=args.highlight, max_rows=args.max_rows, max_cols=args.max_cols)
        text = str(view)
        page = view._repr_html_() if args.html else None
    except (TypeError, ValueError) as e:
        raise _UsageError(str(e)) from None
    except Exception as e:
        raise _UsageError(f"cannot show this plan ({dims}): {type(e).__name__}: {e}") from None
    if page is not None:
        try:
            with open(args.html, "w") as f:
                f.write(f"{_PAGE_HEAD}{page}\n")
        except OSError as e:
            raise _UsageError(f"--html {args.html}: {e.strerror}") from None
    print(text)
    if page is not None:
        print(f"wrote {args.html}")
    return 0


# ---- demo -------------------------------------------------------------------------------------------------
def demo_command(
    nproc: int,
    dims: ParallelDims,
    *,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    rdzv_id: str = "wf-mesh-demo",
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT,
) -> list[str]:
    """The launcher command ``wf-mesh demo`` runs: ``python -m wf_mesh.demo launch <torchrun arguments> -m
    wf_mesh.demo ...``, i.e. torch's launcher (``torch.distributed.run``) run in-process by
    :func:`wf_mesh.demo.launch`, which exits without the interpreter's slow teardown of torch.

    One node: ``--standalone``. Several: ``--nnodes N --rdzv-backend B --rdzv-endpoint HOST:PORT --rdzv-id ID
    --rdzv-conf join_timeout=T,timeout=T`` (and ``--node-rank R`` when given; torchrun's c10d rendezvous
    ignores it and numbers nodes as they join).

    Returns:
        The command's arguments, ``sys.executable`` first.
    """
    if nnodes == 1:
        launch = ["--standalone"]
    else:
        seconds = math.ceil(rdzv_timeout)
        launch = [
            "--nnodes",
            str(nnodes),
            *(["--node-rank", str(node_rank)] if node_rank is not None else []),
            "--rdzv-backend",
            rdzv_backend,
            "--rdzv-endpoint",
            str(rdzv_endpoint),
            "--rdzv-id",
            rdzv_id,
            "--rdzv-conf",
            f"join_timeout={seconds},timeout={seconds}",
        ]
    return [
        sys.executable,
        "-m",
        "wf_mesh.demo",
        "launch",
        *launch,
        "--nproc-per-node",
        str(nproc),
        "-m",
        "wf_mesh.demo",
        *degree_args(dims),
    ]


def _check_nodes(args: argparse.Namespace) -> None:
    if args.nnodes < 1 or args.nproc < 1:
        raise _UsageError(f"--nnodes {args.nnodes} and --nproc {args.nproc} must be >= 1")
    if args.nnodes == 1:
        return
    host, _, port = (args.rdzv_endpoint or "").rpartition(":")
    if not host or not port.isdigit():
        raise _UsageError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (a host every node reaches), "
            f"got {args.rdzv_endpoint!r}"
        )
    if args.rdzv_backend == "static" and not (args.node_rank is not None and 0 <= args.node_rank < args.nnodes):
        raise _UsageError(f"--rdzv-backend static needs --node-rank in [0, {args.nnodes}), got {args.node_rank}")


STAGES = ("started", "imported", "joined", "done")
"""How far a demo worker got: process started, torch imported, joined the gloo world (mesh built), finished."""


def _stages(folder: str) -> dict[str, int]:
    """How many local workers reached each stage (a worker past a stage counts for it too)."""
    counts = dict.fromkeys(STAGES, 0)
    for name in os.listdir(folder):
        if name.endswith(".tmp"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                stage = f.read().strip()
        except OSError:
            continue
        for s in STAGES[: STAGES.index(stage) + 1] if stage in STAGES else ():
            counts[s] += 1
    return counts


class _DemoWatch:
    """The front process's view of a demo launch: progress lines while the workers start, the rendezvous
    timeout, and the output of rank 0 passed through."""

    def __init__(self, args: argparse.Namespace, progress: str) -> None:
        self.args, self.progress = args, progress
        self.start = time.monotonic()
        self.output_started = threading.Event()
        self.last_line, self.last_time = "", 0.0
        self.imported_at: float | None = None

    def on_stdout(self, line: str) -> None:
        self.output_started.set()
        sys.stdout.write(line)
        sys.stdout.flush()

    def _say(self, line: str, now: float) -> None:
        if line != self.last_line or now - self.last_time >= HEARTBEAT:
            print(f"wf-mesh demo: [{now - self.start:.0f} s] {line}", flush=True)
            self.last_line, self.last_time = line, now

    def finished(self, code: int) -> str:
        """The closing line: the exit code and the whole run's time, launcher and imports included."""
        what = "done" if code == 0 else f"exit code {code}"
        return (
            f"{what} after {time.monotonic() - self.start:.1f} s (torchrun, the workers' torch import and the checks)"
        )

    def tick(self) -> None:
        """One look at the workers' progress: maybe a progress line; _Failure past the rendezvous timeout."""
        args, now = self.args, time.monotonic()
        counts = _stages(self.progress)
        n, timeout = args.nproc, args.rdzv_timeout
        if counts["joined"] == n or self.output_started.is_set():
            return
        if counts["started"] == 0:
            if args.nnodes > 1:
                what = (
                    f"{args.nnodes} nodes to join the {args.rdzv_backend} rendezvous at {args.rdzv_endpoint} "
                    f"(id {args.rdzv_id})"
                )
            else:
                what = "torchrun to start the workers"
            if now - self.start > timeout:
                hint = (
                    "; is it running on every node, with the same --rdzv-endpoint and --rdzv-id?"
                    if args.nnodes > 1
                    else ""
                )
                raise _Failure(f"gave up after {timeout:g} s waiting for {what}{hint}")
            self._say(f"waiting for {what}; giving up after {timeout:g} s (--rdzv-timeout)", now)
            return
        if counts["imported"] == n and self.imported_at is None:
            self.imported_at = now
        world = n * args.nnodes
        if self.imported_at is not None and now - self.imported_at > timeout:
            raise _Failure(
                f"gave up after {timeout:g} s waiting for all {world} ranks to join the gloo world "
                f"({counts['joined']} of the {n} local ones joined)"
            )
        waiting = f"; waiting for all {world} ranks to join the gloo world" if counts["imported"] == n else ""
        self._say(
            f"local workers: {counts['started']}/{n} started, {counts['imported']}/{n} imported torch, "
            f"{counts['joined']}/{n} joined{waiting}",
            now,
        )


def _demo(args: argparse.Namespace) -> int:
    _check_nodes(args)
    world_size = args.nnodes * args.nproc
    try:
        dims = _dims(args, world_size)
    except _UsageError as e:
        where = f"--nproc {args.nproc}" if args.nnodes == 1 else f"--nnodes {args.nnodes} x --nproc {args.nproc}"
        raise _UsageError(f"{where}: {e}") from None
    cmd = demo_command(
        args.nproc,
        dims,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        rdzv_timeout=args.rdzv_timeout,
    )
    where = "this machine" if args.nnodes == 1 else f"this node of {args.nnodes} ({world_size} ranks in all)"
    procs = f"{args.nproc} CPU process{'es' if args.nproc > 1 else ''}"
    print(f"wf-mesh demo: launching {procs} on {where} with torchrun: {dims}", flush=True)
    with tempfile.TemporaryDirectory(prefix="wf-mesh-demo-") as progress:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # N processes on one machine: avoid oversubscription (and its warning)
        env[PROGRESS_ENV] = progress
        watch = _DemoWatch(args, progress)
        tree = None
        try:
            with interruptible():
                tree = ProcessTree(cmd, env=env, on_stdout=watch.on_stdout)
                while tree.proc.poll() is None:
                    watch.tick()
                    time.sleep(0.1)
                code = tree.wait()
            print(f"wf-mesh demo: {watch.finished(code)}", flush=True)
            return code
        except Interrupted as e:
            stopped = tree.stop() if tree is not None else 0
            print(f"wf-mesh demo: interrupted by {e}; stopped {stopped} processes", file=sys.stderr, flush=True)
            return e.exit_code
        except _Failure:
            if tree is not None:
                tree.stop()
            raise


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wf-mesh`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except _UsageError as e:
        print(f"wf-mesh {args.command}: error: {e}", file=sys.stderr)
        return 2
    except _Failure as e:
        print(f"wf-mesh {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
