"""The demo ``wf-mesh demo`` runs on every rank: build the mesh with ``dist_init`` on gloo and prove its groups.

Run it under torch's launcher (``wf-mesh demo --nproc 4 --tp 2 --cp 2`` does this for you)::

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m wf_mesh.demo --tp 2 --cp 2

The demo is a list of checks (:data:`CHECKS`). Each is a function of the :class:`DemoContext` that every rank
calls collectively and that returns a one-line result, or raises :class:`CheckFailed`. After each check the
ranks exchange outcomes, so all of them agree; rank 0 prints a per-rank table and one line per check, then
``demo OK: ...``. Any failure is printed (on rank 0, naming the ranks) and every rank exits with code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.mesh import ParallelMesh
from wf_mesh.topology import AXES, ParallelDims
from wf_mesh.viz import PLAN_AXES, format_ranks

__all__ = ["CHECKS", "CheckFailed", "DemoContext", "check_all_reduce", "check_topology", "main", "run_checks"]

TIMEOUT_MINUTES = 5
DEFAULT_ORDER = "tp-cp-pp-dp"


class CheckFailed(Exception):
    """A demo check found a wrong result on this rank."""


@dataclasses.dataclass(frozen=True)
class DemoContext:
    """What every check gets: the mesh, the plan it must match, and this rank."""

    mesh: ParallelMesh
    dims: ParallelDims
    rank: int
    world_size: int


Check = Callable[[DemoContext], str]


def check_topology(ctx: DemoContext) -> str:
    """The mesh's coordinates and groups equal the pure plan (:meth:`ParallelDims.group_of`) on every axis."""
    if ctx.mesh.coords != ctx.dims.coords(ctx.rank):
        raise CheckFailed(f"coords {ctx.mesh.coords} != plan {ctx.dims.coords(ctx.rank)}")
    bad = [
        f"{axis}: mesh {ctx.mesh.ranks(axis)} != plan {ctx.dims.group_of(axis, ctx.rank)}"
        for axis in PLAN_AXES
        if ctx.mesh.ranks(axis) != ctx.dims.group_of(axis, ctx.rank)
    ]
    if bad:
        raise CheckFailed("; ".join(bad))
    return f"topology: coords and the groups of {len(PLAN_AXES)} axes match ParallelDims (order {ctx.dims.order})"


def check_all_reduce(ctx: DemoContext) -> str:
    """All-reduce (SUM) of the global rank over each axis's group equals the sum of that group's ranks."""
    bad = []
    for axis in PLAN_AXES:
        total = torch.tensor([ctx.rank], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.mesh.group(axis))
        expected = sum(ctx.mesh.ranks(axis))
        if total.item() != expected:
            bad.append(f"{axis}: all-reduce gave {total.item()}, sum of {ctx.mesh.ranks(axis)} is {expected}")
    if bad:
        raise CheckFailed("; ".join(bad))
    return f"all-reduce: SUM of the global rank over every group of {len(PLAN_AXES)} axes equals the sum of its ranks"


CHECKS: list[Check] = [check_topology, check_all_reduce]
"""The demo's checks, in order. Later sections append to this list."""


def run_checks(ctx: DemoContext, checks: Sequence[Check] = CHECKS) -> tuple[bool, list[str]]:
    """Run ``checks`` collectively; return ``(all passed, one line per check run)``, the same on every rank.

    Stops at the first check that fails on any rank (its line names the failing ranks and their messages).
    """
    lines = []
    for check in checks:
        try:
            outcome = (True, check(ctx))
        except Exception as e:  # noqa: BLE001 - reported, with the rank, to rank 0
            outcome = (False, e.args[0] if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}")
        outcomes: list[tuple[bool, str]] = [None] * ctx.world_size  # type: ignore[list-item]
        dist.all_gather_object(outcomes, outcome)
        failed = [(rank, message) for rank, (ok, message) in enumerate(outcomes) if not ok]
        if failed:
            details = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
            lines.append(f"FAIL {check.__name__} on ranks {[r for r, _ in failed]}: {details}")
            return False, lines
        lines.append(f"ok   {outcomes[0][1]}")
    return True, lines


def _rank_report(ctx: DemoContext) -> dict:
    return {"rank": ctx.rank, "coords": ctx.mesh.coords, "groups": {a: ctx.mesh.ranks(a) for a in PLAN_AXES}}


def format_report(reports: Sequence[dict]) -> str:
    """Per-rank table: rank, tp/cp/pp/dp coordinates, and this rank's group on every axis."""
    header = ["rank", *AXES, *PLAN_AXES]
    rows = [
        [str(r["rank"]), *(str(r["coords"][a]) for a in AXES), *(format_ranks(r["groups"][a]) for a in PLAN_AXES)]
        for r in reports
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    split = 1 + len(AXES)  # coordinates | groups

    def line(cells: list[str]) -> str:
        left = " ".join(c.rjust(w) for c, w in zip(cells[:split], widths[:split]))
        right = "  ".join(c.ljust(w) for c, w in zip(cells[split:], widths[split:]))
        return f"{left} | {right}".rstrip()

    title = " " * len(line(header).split("|")[0]) + "| groups of this rank"
    return "\n".join([title.rstrip(), line(header), *(line(row) for row in rows)])


def _init(dims: ParallelDims) -> ParallelMesh:
    config = {
        "distributed_backend": "gloo",
        "distributed_timeout_minutes": TIMEOUT_MINUTES,
        "tp_size": dims.tp,
        "cp_size": dims.cp,
        "pp_size": dims.pp,
        "dp_size": dims.dp,
        "order": dims.order,
    }
    return wf_mesh.dist_init(config)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m wf_mesh.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--order", default=DEFAULT_ORDER)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo on this rank (under torchrun); returns the exit code (0 ok, 1 a check failed, 2 bad input)."""
    args = _parse(argv)
    if "WORLD_SIZE" not in os.environ:
        print("wf_mesh.demo: error: WORLD_SIZE is not set; run it with `wf-mesh demo` or torchrun", file=sys.stderr)
        return 2
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    try:
        dims = ParallelDims(tp=args.tp, cp=args.cp, pp=args.pp, order=args.order).resolve(world_size)
    except (TypeError, ValueError) as e:
        if rank == 0:
            print(f"wf_mesh.demo: error: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    mesh = _init(dims)
    try:
        ctx = DemoContext(mesh=mesh, dims=dims, rank=dist.get_rank(), world_size=dist.get_world_size())
        ok, lines = run_checks(ctx)
        reports = [None] * world_size if rank == 0 else None
        dist.gather_object(_rank_report(ctx), reports, dst=0)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(f"wf-mesh demo: {world_size} ranks on {mesh.backend}/{mesh.device_type}, {dims}")
            print(format_report(reports))
            print("\n".join(lines))
            if ok:
                print(f"demo OK: {world_size} ranks, {len(PLAN_AXES)} axes checked in {elapsed:.2f} s")
            else:
                print(f"demo FAILED: {world_size} ranks, {dims}", file=sys.stderr)
            sys.stdout.flush()
    finally:
        wf_mesh.destroy_model_parallel()
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
