"""Context-parallel benchmark: wf_mesh's DTensor gather / broadcast-shard vs the raw collectives, side by side.

Measures, in one run on local gloo processes (CPU):
1. gather of a (2, 4096, 1024) fp32 tensor along dim 1 at cp 2 and cp 4: ``wf_mesh.gather_sequence`` on a
   DTensor vs raw ``all_gather_single`` + reorder (``torch.cat`` of the per-rank chunks along dim 1), the raw
   path allocating its gather buffer per call like the DTensor path ("raw") and reusing one buffer
   ("raw reused": on CPU, glibc maps and unmaps such large blocks on every allocation, so reuse saves the page
   faults; CUDA's caching allocator makes both the same); also the legacy ``cat_outputs_cp`` (which first
   agrees on shapes with a tiny header all-gather) and the gather with fault containment on (one closing
   verdict all-gather more, :mod:`wf_mesh.faults`);
2. per-call overhead on a small (2, 8, 16) tensor: the same three paths, in microseconds per call, the DTensor
   gather with the agreement exchange off (its cost), and ``wf_mesh.broadcast`` vs a raw ``dist.broadcast``;
3. ``broadcast_split_tensor`` (a scatter: each receiver gets its shard) vs broadcast-then-split: bytes each
   receiver gets and time.
Each timing is the median over interleaved trials of the slowest rank. Ratios > 1 mean wf_mesh is slower.
Ratio rows (benchmarks/_report.py): per-trial ratios, their median and spread; targets: gather DTensor / raw
<= 1.10, broadcast_split bytes per receiver = 1/cp of a broadcast.

    python benchmarks/context_parallel.py [--quick] [--json out.json]
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh import _compat, agreement, faults
from wf_mesh.testing import LocalCluster
from wf_mesh.viz import format_table

from _report import (  # benchmarks/ is on sys.path
    at_most,
    benchmark_parser,
    equals,
    per_trial,
    ratio_row,
    report,
)
from _timing import compare_trials, timed_dist


def gather_paths(shape: tuple[int, ...], iters: int, trials: int) -> dict[str, list[float]]:
    wf_mesh.initialize_model_parallel(cp_size=dist.get_world_size())
    mesh = wf_mesh.get_parallel_mesh()
    cp, group = mesh.size("cp"), mesh.group("cp")
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))  # the same on every rank
    dt = wf_mesh.shard_sequence(full, 1, as_dtensor=True)
    local = dt.to_local()
    out = torch.empty((cp * local.shape[0], *local.shape[1:]))

    def raw():  # allocates its gather buffer per call, as any function returning a new tensor does
        gathered = torch.empty((cp * local.shape[0], *local.shape[1:]))
        _compat.all_gather_single(gathered, local, group=group)
        return torch.cat(gathered.chunk(cp, 0), dim=1)

    def raw_reused():  # reuses one gather buffer across calls (only the reordered result is new)
        _compat.all_gather_single(out, local, group=group)
        return torch.cat(out.chunk(cp, 0), dim=1)

    def unchecked():  # the same call with the validation-only agreement exchange off (WF_MESH_CHECKS=0)
        agreement.set_checks(False)
        try:
            return wf_mesh.gather_sequence(dt)
        finally:
            agreement.set_checks(True)

    def contained():  # the same call with fault containment on: one closing verdict all-gather more
        faults.set_containment(True)
        try:
            return wf_mesh.gather_sequence(dt)
        finally:
            faults.set_containment(None)

    def raw_broadcast():
        dist.broadcast(local, group=group, group_src=0)
        return local

    assert torch.equal(raw(), full) and torch.equal(wf_mesh.gather_sequence(dt), full)
    return compare_trials(
        {
            "raw": raw,
            "raw_reused": raw_reused,
            "wf_mesh": lambda: wf_mesh.gather_sequence(dt),
            "wf_mesh_unchecked": unchecked,
            "wf_mesh_contained": contained,
            "legacy": lambda: wf_mesh.cat_outputs_cp(local, 1, group),
            "raw_broadcast": raw_broadcast,
            "broadcast": lambda: wf_mesh.broadcast(local, group),
        },
        iters,
        trials,
        timed_dist,
    )


def broadcast_split_paths(shape: tuple[int, ...], iters: int, trials: int) -> dict:
    wf_mesh.initialize_model_parallel(cp_size=dist.get_world_size())
    group = wf_mesh.parallel_state.get_cp_group()
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    source = torch.randn(shape)
    buffer = torch.empty(shape)

    def broadcast_then_split():
        dist.broadcast(buffer if rank else source, group=group, group_src=0)
        return torch.chunk(buffer if rank else source, cp, 1)[rank].contiguous()

    def scatter():
        return wf_mesh.broadcast_split_tensor(source if rank == 0 else None, 1, group)

    shard = scatter()
    assert torch.equal(broadcast_then_split(), shard)
    paths = {"broadcast_then_split": broadcast_then_split, "broadcast_split_tensor": scatter}
    times = compare_trials(paths, iters, trials, timed_dist)
    # bytes one receiver gets: its shard (scatter) vs the whole tensor (broadcast-then-split)
    return {**times, "bytes_per_receiver": shard.nbytes, "broadcast_bytes_per_receiver": buffer.nbytes}


def med(samples: list[float]) -> float:
    return statistics.median(samples)


def ratio_rows(results: dict, quick: bool) -> list[dict]:
    rows = []

    def row(measurement, ratios, target=None):
        rows.append(ratio_row("context_parallel", measurement, ratios, target, quick=quick))

    for cp, g in results["gather"].items():
        row(f"gather cp {cp}: wf_mesh DTensor / raw all-gather", per_trial(g["wf_mesh"], g["raw"]), at_most(1.10))
        row(f"gather cp {cp}: wf_mesh DTensor, checks off / raw", per_trial(g["wf_mesh_unchecked"], g["raw"]))
        row(f"gather cp {cp}: legacy cat_outputs_cp / raw", per_trial(g["legacy"], g["raw"]))
        row(f"gather cp {cp}: contain_faults on / off", per_trial(g["wf_mesh_contained"], g["wf_mesh"]))
        row(f"gather cp {cp}: wf_mesh / raw reusing its gather buffer", per_trial(g["wf_mesh"], g["raw_reused"]))
    for cp, s in results["small"].items():
        overhead = (med(s["wf_mesh"]) - med(s["raw"])) * 1e6
        row(f"small gather cp {cp}: wf_mesh / raw ({overhead:+.0f} us/call)", per_trial(s["wf_mesh"], s["raw"]))
        agreement_us = (med(s["wf_mesh"]) - med(s["wf_mesh_unchecked"])) * 1e6
        row(
            f"small gather cp {cp}: checks on / off (agreement {agreement_us:+.0f} us/call)",
            per_trial(s["wf_mesh"], s["wf_mesh_unchecked"]),
        )
        close_us = (med(s["wf_mesh_contained"]) - med(s["wf_mesh"])) * 1e6
        row(
            f"small gather cp {cp}: contain_faults on / off (close {close_us:+.0f} us/call)",
            per_trial(s["wf_mesh_contained"], s["wf_mesh"]),
        )
        overhead = (med(s["broadcast"]) - med(s["raw_broadcast"])) * 1e6
        row(
            f"small broadcast cp {cp}: wf_mesh.broadcast / dist.broadcast ({overhead:+.0f} us/call)",
            per_trial(s["broadcast"], s["raw_broadcast"]),
        )
    for cp, b in results["broadcast_split"].items():
        share = b["bytes_per_receiver"] / b["broadcast_bytes_per_receiver"]
        row(f"broadcast_split cp {cp}: bytes per receiver / broadcast", share, equals(1 / cp, f"= 1/{cp}"))
        row(
            f"broadcast_split cp {cp}: time scatter / broadcast-then-split",
            per_trial(b["broadcast_split_tensor"], b["broadcast_then_split"]),
        )
    return rows


def main() -> None:
    args = benchmark_parser(__doc__).parse_args()
    big = (2, 512, 128) if args.quick else (2, 4096, 1024)
    iters, trials = (2, 2) if args.quick else (5, 5)
    small_iters = 10 if args.quick else 200
    results: dict = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "big_shape": big,
        "gather": {},
        "small": {},
        "broadcast_split": {},
    }
    for cp in (2, 4):
        cluster = LocalCluster(cp).start()
        try:
            results["gather"][cp] = cluster.run(gather_paths, big, iters, trials)[0]
            results["small"][cp] = cluster.run(gather_paths, (2, 8, 16), small_iters, trials)[0]
            results["broadcast_split"][cp] = cluster.run(broadcast_split_paths, big, iters, trials)[0]
        finally:
            cluster.shutdown()

    print(f"# wf_mesh context-parallel benchmark  torch {torch.__version__}, {os.cpu_count()} CPUs, gloo")
    print(f"\n## gather {big} fp32 along dim 1 ({'quick' if args.quick else 'full'}; ms, median of {trials} trials)")
    table = []
    for cp, r in results["gather"].items():
        raw, wf, legacy, reused = (med(r[k]) for k in ("raw", "wf_mesh", "legacy", "raw_reused"))
        table.append(
            [
                cp,
                f"{raw * 1e3:.2f}",
                f"{wf * 1e3:.2f}",
                f"{wf / raw:.2f}",
                f"{legacy * 1e3:.2f}",
                f"{legacy / raw:.2f}",
                f"{reused * 1e3:.2f}",
                f"{wf / reused:.2f}",
            ]
        )
    head = ["cp", "raw ms", "wf_mesh ms", "ratio", "legacy ms", "ratio", "raw reused ms", "wf_mesh/reused"]
    print(format_table(head, table, align="r" * len(head)))
    print("\n## per-call cost on a small (2, 8, 16) tensor (us per call; overhead = wf_mesh - raw)")
    table = []
    for cp, r in results["small"].items():
        raw, wf, legacy = (med(r[k]) * 1e6 for k in ("raw", "wf_mesh", "legacy"))
        table.append([cp, f"{raw:.0f}", f"{wf:.0f}", f"{wf - raw:.0f}", f"{legacy:.0f}", f"{legacy - raw:.0f}"])
    print(format_table(["cp", "raw", "wf_mesh", "overhead", "legacy", "overhead"], table, align="rrrrrr"))
    full_bytes = torch.Size(big).numel() * 4
    print(f"\n## broadcast_split_tensor (scatter) vs broadcast-then-split of {big} fp32")
    table = []
    for cp, r in results["broadcast_split"].items():
        bcast, scatter = med(r["broadcast_then_split"]), med(r["broadcast_split_tensor"])
        table.append(
            [
                cp,
                f"{full_bytes // cp:,}",
                f"1/{cp} of {full_bytes:,}",
                f"{bcast * 1e3:.2f}",
                f"{scatter * 1e3:.2f}",
                f"{scatter / bcast:.2f}",
            ]
        )
    head = ["cp", "bytes/receiver", "vs broadcast", "bcast+split ms", "scatter ms", "ratio"]
    print(format_table(head, table, align="r" * len(head)))
    rows = ratio_rows(results, args.quick)
    print()
    report("context_parallel", args, rows, results)


if __name__ == "__main__":
    main()
