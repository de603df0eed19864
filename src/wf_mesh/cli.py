"""The ``wf-mesh`` command line.

Subcommands::

    wf-mesh plan --world-size 16 --tp 2 --cp 2 --pp 2 [--dp N] [--order tp-cp-pp-dp]
        Print the rank grid and every axis's groups (pure arithmetic: no processes are started).
    wf-mesh demo --nproc 4 --tp 2 --cp 2 [--pp 1] [--order tp-cp-pp-dp]
        Launch N local CPU processes (gloo) with torch's own launcher and run :mod:`wf_mesh.demo` on them.

Bad degrees are reported as one line on stderr with exit code 2, before anything is launched.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

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

    parser = argparse.ArgumentParser(prog="wf-mesh", description="Plan and try tp/cp/pp/dp process-group layouts.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,demo}")

    plan = sub.add_parser("plan", help="print the rank layout and groups of a world (no processes)")
    plan.add_argument("--world-size", type=int, required=True, help="number of ranks")
    _add_degrees(plan)
    plan.add_argument("--dp", type=int, default=-1, help="data-parallel degree (default: inferred)")
    plan.set_defaults(func=_plan)

    demo = sub.add_parser("demo", help="run the mesh on N local CPU processes (gloo) and check every group")
    demo.add_argument("--nproc", type=int, required=True, help="number of local processes (the world size)")
    _add_degrees(demo)
    demo.set_defaults(func=_demo)
    return parser


def _resolve(args: argparse.Namespace, world_size: int, dp: int = -1) -> ParallelDims:
    try:
        return ParallelDims(tp=args.tp, cp=args.cp, pp=args.pp, dp=dp, order=args.order).resolve(world_size)
    except (TypeError, ValueError) as e:
        raise _UsageError(str(e)) from None


def _plan(args: argparse.Namespace) -> int:
    print(format_plan(_resolve(args, args.world_size, args.dp)))
    return 0


def demo_command(nproc: int, dims: ParallelDims) -> list[str]:
    """The launcher command ``wf-mesh demo`` runs: ``python -m torch.distributed.run ... -m wf_mesh.demo ...``."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "wf_mesh.demo",
        "--tp", str(dims.tp), "--cp", str(dims.cp), "--pp", str(dims.pp), "--order", dims.order,
    ]  # fmt: skip


def _demo(args: argparse.Namespace) -> int:
    try:
        dims = _resolve(args, args.nproc)
    except _UsageError as e:
        raise _UsageError(f"--nproc {args.nproc}: {e}") from None
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # N processes on one machine: avoid oversubscription (and its warning)
    try:
        return subprocess.run(demo_command(args.nproc, dims), env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130


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
