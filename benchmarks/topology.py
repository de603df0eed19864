"""Topology benchmark: planning at 100k ranks, and mesh build cost per rank at 1k-16k simulated ranks.

What is measured (docs/design.md section 10, "Topology"), side by side in one run:

1. Planning with the pure ``ParallelDims`` at 100,000 ranks (tp=8, cp=5, pp=5 -> dp=500): ``resolve``, then
   ``groups(axis)`` (every group of the world) and ``group_of(axis, rank)`` (one rank's group) for every base
   and derived axis. No torch.distributed involved. Median of a few repetitions, in milliseconds.
2. Building the process groups for ONE simulated rank of an N-rank world (N = 1k, 4k, 16k; tp=8, cp=4, pp=4),
   on torch's ``fake`` backend (one process pretending to be rank r of N; no communication):
   - wf_mesh: ``init_parallel(dims)`` (one ``init_device_mesh`` + the flattened derived axes), then ``destroy()``;
   - Megatron style: for every base and derived axis, ``dist.new_group(ranks)`` for every group of that axis
     (``dims.groups(axis)``), as Megatron's ``initialize_model_parallel`` does; then the groups are destroyed.
   Only the build is timed (median over repetitions, after one untimed warm-up of each). Each N runs in its own
   subprocess (``--child N``), because a process's default group is initialized once, for one world size.
   Garbage collection is paused while timing (as ``timeit`` does): a collection triggered by the allocations
   would land in whichever call happens to be running.
   "groups held" is how many process groups this rank ends up in; "new_group calls" counts every collective
   ``new_group`` call, including those for groups this rank is not in (all ranks must make them).

Run::

    .venv/bin/python benchmarks/topology.py                 # full run (about a minute)
    .venv/bin/python benchmarks/topology.py --quick         # 1k ranks only, fewer repetitions (smoke test)
    .venv/bin/python benchmarks/topology.py --json out.json # also write the ratio rows and results as JSON

Ratio rows (benchmarks/_report.py): planning time / 1 s (target: well under 1), and per world size the
Megatron-style build / the wf_mesh build (reported), each with its spread over the repetitions.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from wf_mesh import ParallelDims
from wf_mesh.viz import format_table

from _report import (  # benchmarks/ is on sys.path
    below,
    benchmark_parser,
    format_rows,
    per_trial,
    ratio_row,
    write_json,
)

PLAN_WORLD = 100_000
PLAN_DIMS = ParallelDims(tp=8, cp=5, pp=5)
MESH_DIMS = ParallelDims(tp=8, cp=4, pp=4)
ALL_AXES = PLAN_DIMS.shown_axes
"""Every axis a mesh of these dims holds (base and derived; cfg only at 2, which these dims do not use)."""
TIMEOUT = datetime.timedelta(minutes=30)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


# ---- 1. planning (pure) ------------------------------------------------------------------------------------
def bench_planning(reps: int) -> dict:
    rank = PLAN_WORLD // 2 + 1
    resolve, groups, group_of = [], {a: [] for a in ALL_AXES}, {a: [] for a in ALL_AXES}
    for _ in range(reps):
        t0 = time.perf_counter()
        dims = PLAN_DIMS.resolve(PLAN_WORLD)
        resolve.append(time.perf_counter() - t0)
        for axis in ALL_AXES:
            t0 = time.perf_counter()
            all_groups = dims.groups(axis)
            groups[axis].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mine = dims.group_of(axis, rank)
            group_of[axis].append(time.perf_counter() - t0)
            assert rank in mine and len(all_groups) * len(mine) == PLAN_WORLD  # sanity, not timed
            del all_groups  # freeing 100k ranks stays out of the next timed call
    per_axis = {
        axis: {
            "num_groups": PLAN_WORLD // dims.degree(axis),
            "group_size": dims.degree(axis),
            "groups_ms": _ms(statistics.median(groups[axis])),
            "group_of_ms": _ms(statistics.median(group_of[axis])),
        }
        for axis in ALL_AXES
    }
    totals = [resolve[i] + sum(groups[a][i] + group_of[a][i] for a in ALL_AXES) for i in range(reps)]
    return {
        "world_size": PLAN_WORLD,
        "dims": str(dims),
        "rank": rank,
        "reps": reps,
        "resolve_ms": _ms(statistics.median(resolve)),
        "axes": per_axis,
        "total_ms": _ms(statistics.median(totals)),
        "total_ms_per_rep": [_ms(t) for t in totals],
    }


# ---- 2. mesh build on the fake backend (one subprocess per world size) ----------------------------------------
def child(world_size: int, reps: int) -> dict:
    """Runs in a fresh process: time both ways of building the groups for one simulated rank."""
    import torch.distributed as dist

    from wf_mesh import _compat, init_parallel
    from wf_mesh.testing import process_group_counts

    _compat.register_fake_backend()
    rank = world_size // 2 + 1
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore(), timeout=TIMEOUT)
    dims = MESH_DIMS.resolve(world_size)

    def wf_mesh_build():
        groups0, calls0 = process_group_counts()
        t0 = time.perf_counter()
        pm = init_parallel(dims)
        elapsed = time.perf_counter() - t0
        groups1, calls1 = process_group_counts()
        pm.destroy()
        return elapsed, groups1 - groups0, calls1 - calls0

    def megatron_build():
        groups0, calls0 = process_group_counts()
        t0 = time.perf_counter()
        mine = []
        for axis in dims.shown_axes:  # the groups the mesh holds
            for ranks in dims.groups(axis):
                group = dist.new_group(ranks, timeout=TIMEOUT)
                if rank in ranks:
                    mine.append(group)
        elapsed = time.perf_counter() - t0
        groups1, calls1 = process_group_counts()
        for group in mine:
            dist.destroy_process_group(group)
        return elapsed, groups1 - groups0, calls1 - calls0

    methods = {"wf_mesh": wf_mesh_build, "megatron": megatron_build}
    for build in methods.values():  # warm-up: first-call imports and caches
        build()
    times = {name: [] for name in methods}
    counts = {}
    for _ in range(reps):
        for name, build in methods.items():  # interleaved, so drift affects both alike
            gc.collect()  # untimed; collection is off inside the timed build
            elapsed, groups, calls = build()
            times[name].append(elapsed)
            counts[name] = {"groups_held": groups, "new_group_calls": calls}
    dist.destroy_process_group()
    result = {"world_size": world_size, "dims": str(dims), "rank": rank, "reps": reps}
    for name in methods:
        result[name] = {
            "build_ms": _ms(statistics.median(times[name])),
            **counts[name],
            "build_ms_per_rep": [_ms(t) for t in times[name]],
        }
    result["ratios"] = per_trial(times["megatron"], times["wf_mesh"])
    result["ratio"] = round(statistics.median(result["ratios"]), 2)
    return result


def run_child(world_size: int, reps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(world_size), "--reps", str(reps)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"child for {world_size} ranks failed (rc={proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- report --------------------------------------------------------------------------------------------------
def ratio_rows(planning: dict, builds: list[dict], quick: bool) -> list[dict]:
    rows = [
        ratio_row(
            "topology",
            f"planning {planning['world_size']:,} ranks (groups of {len(ALL_AXES)} axes) / 1 s",
            [ms / 1e3 for ms in planning["total_ms_per_rep"]],
            below(1, "< 1 (well under 1 s)"),
            quick=quick,
        )
    ]
    for b in builds:
        what = f"mesh build, {b['world_size']} ranks: megatron new_group loop / wf_mesh"
        rows.append(ratio_row("topology", what, b["ratios"], quick=quick))
    return rows


def print_report(header: str, planning: dict, builds: list[dict], rows: list[dict]) -> None:
    print(header)
    print()
    print(
        f"1. Planning with ParallelDims (pure, no torch.distributed): {planning['dims']}, "
        f"{planning['world_size']:,} ranks, median of {planning['reps']}"
    )
    print(f"   resolve: {planning['resolve_ms']:.3f} ms")
    table = [
        [axis, r["num_groups"], r["group_size"], f"{r['groups_ms']:.3f}", f"{r['group_of_ms']:.3f}"]
        for axis, r in planning["axes"].items()
    ]
    print(
        format_table(["axis", "groups", "size", "groups() ms", "group_of(rank) ms"], table, align="lrrrr", indent="   ")
    )
    print(f"   total (resolve + all groups() + all group_of()): {planning['total_ms']:.1f} ms")
    print()
    print(
        f"2. Process-group build for ONE simulated rank, fake backend, tp=8 cp=4 pp=4 (dp = N/128), "
        f"median of {builds[0]['reps']}"
    )
    print("   wf_mesh = init_parallel (one init_device_mesh + flattened derived axes); megatron = dist.new_group")
    print(f"   for every group of every axis ({', '.join(MESH_DIMS.shown_axes)}). ratio > 1: wf_mesh is faster.")
    table = []
    for b in builds:
        wf, mg = b["wf_mesh"], b["megatron"]
        table.append(
            [
                b["world_size"],
                f"{wf['build_ms']:.1f}",
                f"{mg['build_ms']:.1f}",
                f"{b['ratio']:.2f}",
                f"{wf['groups_held']}/{mg['groups_held']}",
                f"{wf['new_group_calls']}/{mg['new_group_calls']}",
            ]
        )
    head = [
        "ranks",
        "wf_mesh build (ms)",
        "megatron new_group loop (ms)",
        "ratio (megatron / wf_mesh)",
        "groups held wf/meg",
        "new_group calls wf/meg",
    ]
    print(format_table(head, table, align="rrrrrr", rule=True, indent="   "))
    print()
    print(format_rows(rows))


def main() -> None:
    parser = benchmark_parser(__doc__, quick="1k ranks only, fewer repetitions (smoke test)")
    parser.add_argument("--child", type=int, metavar="N", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        gc.disable()
        print(json.dumps(child(args.child, args.reps)))
        return

    sizes, plan_reps, build_reps = ((1024,), 3, 3) if args.quick else ((1024, 4096, 16384), 7, 5)
    header = (
        f"wf_mesh topology benchmark | torch {torch.__version__} | python {platform.python_version()} | "
        f"{platform.system()} {platform.machine()} | os.cpu_count()={os.cpu_count()}"
        f"{' | --quick' if args.quick else ''}"
    )
    gc.disable()
    planning = bench_planning(plan_reps)
    gc.enable()
    builds = [run_child(n, build_reps) for n in sizes]
    rows = ratio_rows(planning, builds, args.quick)
    print_report(header, planning, builds, rows)
    if args.json:
        write_json(
            args.json, "topology", args.quick, rows, {"header": header, "planning": planning, "mesh_build": builds}
        )


if __name__ == "__main__":
    main()
