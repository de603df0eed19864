"""The ``wf-mesh`` command line.

Subcommands::

    wf-mesh plan --world-size 16 --tp 2 --cp 2 --pp 2 [--dp N] [--order tp-cp-pp-dp]
        Print the rank grid and every axis's groups (pure arithmetic: no processes are started).
    wf-mesh demo --nproc 4 --tp 2 --cp 2 [--pp 1] [--order tp-cp-pp-dp]
        Launch N local CPU processes (gloo) with torch's own launcher and run :mod:`wf_mesh.demo` on them.
    wf-mesh demo --nproc 2 --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT --tp 2 --cp 2
        The same across several machines (run it on every node; the world is nnodes x nproc ranks): torchrun's
        multi-node rendezvous (``--rdzv-backend c10d`` by default) at HOST:PORT, a host every node reaches.
    wf-mesh bench [--quick] [--only topology,state] [--json PATH] [--dir PATH]
        Run the checkout's benchmarks/*.py and print one table of ratios, with the targets of DESIGN.md §7.

Bad input is reported as one line on stderr with exit code 2, before anything is launched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from wf_mesh import bench
from wf_mesh.topology import ParallelDims
from wf_mesh.viz import format_plan

__all__ = ["build_parser", "demo_command", "main"]


class _UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def _add_degrees(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (default 1)")
    parser.add_argument(
        "--order", default="tp-cp-pp-dp", help="rank order, fastest-varying axis first (default tp-cp-pp-dp)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``wf-mesh`` (one subparser per subcommand)."""
    from wf_mesh import __version__

    parser = argparse.ArgumentParser(
        prog="wf-mesh", description="Plan, try and benchmark tp/cp/pp/dp process-group layouts."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,demo,bench}")

    plan = sub.add_parser("plan", help="print the rank layout and groups of a world (no processes)")
    plan.add_argument("--world-size", type=int, required=True, help="number of ranks")
    _add_degrees(plan)
    plan.add_argument("--dp", type=int, default=-1, help="data-parallel degree (default: inferred)")
    plan.set_defaults(func=_plan)

    demo = sub.add_parser("demo", help="run the mesh, CP, FSDP2 + EMA and the pipeline ring on CPU processes (gloo)")
    demo.add_argument("--nproc", type=int, required=True, help="processes per node (the world size on one node)")
    _add_degrees(demo)
    nodes = demo.add_argument_group("several nodes (run the same command on every node)")
    nodes.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1: a standalone local run)")
    nodes.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous; c10d numbers nodes)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous address that every node reaches")
    nodes.add_argument("--rdzv-backend", choices=("c10d", "static"), default="c10d", help="default c10d")
    nodes.add_argument("--rdzv-id", default="wf-mesh-demo", help="job id, the same on every node")
    demo.set_defaults(func=_demo)

    run = sub.add_parser("bench", help="run the benchmark scripts and print one table of ratios")
    run.add_argument("--quick", action="store_true", help="pass --quick to every script (smoke run, noisy ratios)")
    run.add_argument("--only", metavar="NAMES", help=f"comma-separated subset of {','.join(bench.BENCHMARKS)}")
    run.add_argument("--json", metavar="PATH", help="also write the table (and each script's JSON) to PATH")
    run.add_argument("--dir", metavar="PATH", help="folder of the scripts (default: the checkout's benchmarks/)")
    run.set_defaults(func=_bench)
    return parser


def _resolve(args: argparse.Namespace, world_size: int, dp: int = -1) -> ParallelDims:
    try:
        return ParallelDims(tp=args.tp, cp=args.cp, pp=args.pp, dp=dp, order=args.order).resolve(world_size)
    except (TypeError, ValueError) as e:
        raise _UsageError(str(e)) from None


def _plan(args: argparse.Namespace) -> int:
    print(format_plan(_resolve(args, args.world_size, args.dp)))
    return 0


def demo_command(
    nproc: int,
    dims: ParallelDims,
    *,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    rdzv_id: str = "wf-mesh-demo",
) -> list[str]:
    """The launcher command ``wf-mesh demo`` runs: ``python -m torch.distributed.run ... -m wf_mesh.demo ...``.

    One node: ``--standalone``. Several: ``--nnodes N --rdzv-backend B --rdzv-endpoint HOST:PORT --rdzv-id ID``
    (and ``--node-rank R`` when given; torchrun's c10d rendezvous ignores it and numbers nodes as they join).
    """
    if nnodes == 1:
        launch = ["--standalone"]
    else:
        launch = ["--nnodes", str(nnodes), *(["--node-rank", str(node_rank)] if node_rank is not None else []),
                  "--rdzv-backend", rdzv_backend, "--rdzv-endpoint", str(rdzv_endpoint), "--rdzv-id", rdzv_id]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", *launch, "--nproc-per-node", str(nproc),
        "-m", "wf_mesh.demo",
        "--tp", str(dims.tp), "--cp", str(dims.cp), "--pp", str(dims.pp), "--order", dims.order,
    ]  # fmt: skip


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


def _demo(args: argparse.Namespace) -> int:
    _check_nodes(args)
    world_size = args.nnodes * args.nproc
    try:
        dims = _resolve(args, world_size)
    except _UsageError as e:
        where = f"--nproc {args.nproc}" if args.nnodes == 1 else f"--nnodes {args.nnodes} x --nproc {args.nproc}"
        raise _UsageError(f"{where}: {e}") from None
    cmd = demo_command(
        args.nproc, dims, nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id,
    )  # fmt: skip
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # N processes on one machine: avoid oversubscription (and its warning)
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130


def _selected(only: str | None) -> list[str]:
    if only is None:
        return list(bench.BENCHMARKS)
    names = [n.strip().replace("-", "_").removesuffix(".py") for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in bench.BENCHMARKS]
    if unknown or not names:
        raise _UsageError(f"--only {only!r}: unknown benchmark(s) {unknown}; choose from {list(bench.BENCHMARKS)}")
    return [n for n in bench.BENCHMARKS if n in names]


def _bench(args: argparse.Namespace) -> int:
    names = _selected(args.only)
    try:
        folder = bench.benchmarks_dir(args.dir, names)
    except FileNotFoundError as e:
        raise _UsageError(str(e)) from None
    rows, results, failed = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="wf-mesh-bench-") as tmp:
        for i, name in enumerate(names, 1):
            script = folder / f"{name}.py"
            print(f"[{i}/{len(names)}] {script}{' --quick' if args.quick else ''} ...", end=" ", flush=True)
            start = time.perf_counter()
            try:
                results[name] = bench.run_benchmark(script, Path(tmp) / f"{name}.json", quick=args.quick)
                rows += bench.ratio_rows(name, results[name])
            except (RuntimeError, KeyError, ValueError) as e:  # a failed script, or JSON without a field we read
                failed[name] = f"{type(e).__name__}: {e}"
            print(f"{'FAILED' if name in failed else 'done'} in {time.perf_counter() - start:.1f} s", flush=True)
    if rows:
        print()
        print(bench.format_table(rows))
        print(f"ratio = first named / second, measured side by side in one run; targets: DESIGN.md section 7"
              f"{'; --quick: small sizes, few iterations, noisy' if args.quick else ''}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"quick": args.quick, "rows": rows, "results": results, "failed": failed}, f, indent=2)
        print(f"wrote {args.json}")
    for name, error in failed.items():
        print(f"wf-mesh bench: {name} failed: {error}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wf-mesh`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except _UsageError as e:
        print(f"wf-mesh {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
