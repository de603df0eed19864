"""Context-parallel benchmark: wf_mesh's DTensor gather / broadcast-shard vs the raw collectives, side by side.

Measures, in one run on local gloo processes (CPU):
1. gather of a (2, 4096, 1024) fp32 tensor along dim 1 at cp 2 and cp 4: ``wf_mesh.gather_sequence`` on a
   DTensor vs raw ``all_gather_single`` + reorder (``torch.cat`` of the per-rank chunks along dim 1), the raw
   path allocating its gather buffer per call like the DTensor path ("raw") and reusing one buffer
   ("raw reused": on CPU, glibc maps and unmaps such large blocks on every allocation, so reuse saves the page
   faults; CUDA's caching allocator makes both the same); also the legacy ``cat_outputs_cp`` (which first
   agrees on shapes with a tiny header all-gather);
2. per-call overhead on a small (2, 8, 16) tensor: the same three paths, in microseconds per call;
3. ``broadcast_split_tensor`` (a scatter: each receiver gets its shard) vs broadcast-then-split: bytes each
   receiver gets and time.
Each timing is the median over interleaved trials of the slowest rank. Ratios > 1 mean wf_mesh is slower.

    python benchmarks/context_parallel.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import wf_mesh
from _timing import compare, timed_dist  # benchmarks/ is on sys.path when a script runs
from wf_mesh.testing import LocalCluster


def gather_paths(shape: tuple[int, ...], iters: int, trials: int) -> dict[str, float]:
    wf_mesh.initialize_model_parallel(cp_size=dist.get_world_size())
    mesh = wf_mesh.get_parallel_mesh()
    cp, group = mesh.size("cp"), mesh.group("cp")
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))  # the same on every rank
    dt = wf_mesh.shard_sequence(full, 1)
    local = dt.to_local()
    out = torch.empty((cp * local.shape[0], *local.shape[1:]))

    def raw():  # allocates its gather buffer per call, as any function returning a new tensor does
        gathered = torch.empty((cp * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(gathered, local, group=group)
        return torch.cat(gathered.chunk(cp, 0), dim=1)

    def raw_reused():  # reuses one gather buffer across calls (only the reordered result is new)
        dist.all_gather_single(out, local, group=group)
        return torch.cat(out.chunk(cp, 0), dim=1)

    assert torch.equal(raw(), full) and torch.equal(wf_mesh.gather_sequence(dt), full)
    return compare(
        {
            "raw": raw,
            "raw_reused": raw_reused,
            "wf_mesh": lambda: wf_mesh.gather_sequence(dt),
            "legacy": lambda: wf_mesh.cat_outputs_cp(local, 1, group),
        },
        iters,
        trials,
        timed_dist,
    )


def broadcast_split_paths(shape: tuple[int, ...], iters: int, trials: int) -> dict[str, float]:
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
    times = compare(paths, iters, trials, timed_dist)
    # bytes one receiver gets: its shard (scatter) vs the whole tensor (broadcast-then-split)
    return {**times, "bytes_per_receiver": shard.nbytes, "broadcast_bytes_per_receiver": buffer.nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations (smoke test)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    big = (2, 512, 128) if args.quick else (2, 4096, 1024)
    iters, trials = (2, 2) if args.quick else (5, 5)
    small_iters = 20 if args.quick else 200
    results: dict = {"torch": torch.__version__, "cpus": os.cpu_count(), "big_shape": big, "gather": {}, "small": {}}
    print(f"# wf_mesh context-parallel benchmark  torch {torch.__version__}, {os.cpu_count()} CPUs, gloo")
    print(f"\n## gather {big} fp32 along dim 1 ({'quick' if args.quick else 'full'})")
    print(f"{'cp':>3} {'raw ms':>9} {'wf_mesh ms':>11} {'ratio':>6} {'legacy ms':>10} {'ratio':>6} "
          f"{'raw reused ms':>14} {'wf_mesh/reused':>15}")  # fmt: skip
    small = {}
    for cp in (2, 4):
        cluster = LocalCluster(cp).start()
        try:
            r = cluster.run(gather_paths, big, iters, trials)[0]
            small[cp] = cluster.run(gather_paths, (2, 8, 16), small_iters, trials)[0]
            split = cluster.run(broadcast_split_paths, big, iters, trials)[0]
        finally:
            cluster.shutdown()
        results["gather"][cp] = r
        results["small"][cp] = small[cp]
        results.setdefault("broadcast_split", {})[cp] = split
        print(f"{cp:>3} {r['raw'] * 1e3:>9.2f} {r['wf_mesh'] * 1e3:>11.2f} {r['wf_mesh'] / r['raw']:>6.2f} "
              f"{r['legacy'] * 1e3:>10.2f} {r['legacy'] / r['raw']:>6.2f} {r['raw_reused'] * 1e3:>14.2f} "
              f"{r['wf_mesh'] / r['raw_reused']:>15.2f}")  # fmt: skip
    print("\n## per-call cost on a small (2, 8, 16) tensor (us per call; overhead = wf_mesh - raw)")
    print(f"{'cp':>3} {'raw':>8} {'wf_mesh':>8} {'overhead':>9} {'legacy':>8} {'overhead':>9}")
    for cp, r in small.items():
        print(f"{cp:>3} {r['raw'] * 1e6:>8.0f} {r['wf_mesh'] * 1e6:>8.0f} {(r['wf_mesh'] - r['raw']) * 1e6:>9.0f} "
              f"{r['legacy'] * 1e6:>8.0f} {(r['legacy'] - r['raw']) * 1e6:>9.0f}")  # fmt: skip
    full_bytes = torch.Size(big).numel() * 4
    print(f"\n## broadcast_split_tensor (scatter) vs broadcast-then-split of {big} fp32")
    print(f"{'cp':>3} {'bytes/receiver':>15} {'vs broadcast':>13} {'bcast+split ms':>15} {'scatter ms':>11} {'ratio':>6}")
    for cp, r in results["broadcast_split"].items():
        print(f"{cp:>3} {full_bytes // cp:>15,} {f'1/{cp} of {full_bytes:,}':>13} "
              f"{r['broadcast_then_split'] * 1e3:>15.2f} {r['broadcast_split_tensor'] * 1e3:>11.2f} "
              f"{r['broadcast_split_tensor'] / r['broadcast_then_split']:>6.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
