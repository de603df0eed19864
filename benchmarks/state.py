"""Shard-local state benchmark: EMA update vs a copy_ of the same bytes, foreach vs loop, bucketed broadcast.

Measures, in one run:
1. EMA update of ~100M float32 parameters (single process): ``ShardedEMA.update`` vs a ``copy_`` of the same
   bytes (``torch._foreach_copy_`` over the same tensors, and one flat ``copy_``), and vs a bare
   ``torch._foreach_lerp_`` (the floor our wrapper adds its per-call checks to); also a bf16 model (mul + add);
2. EMA of many small tensors: ``ShardedEMA.update`` (foreach) vs a Python loop of ``lerp_``;
3. ``broadcast_dtensor_model_states`` (bucketed) vs one ``dist.broadcast`` per tensor, on local gloo processes,
   for a model with hundreds of small parameters and buffers: time and number of collectives.
Each timing is the median over interleaved trials (the slowest rank for the broadcast). Design targets
(docs/design.md section 10): EMA within 10% of copy_; broadcast collectives ~ buckets, well ahead of per-tensor.
Ratio rows (benchmarks/_report.py): per-trial ratios, their median and spread.

    python benchmarks/state.py [--quick] [--json out.json]
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from wf_mesh import ShardedEMA, _compat, broadcast_dtensor_model_states
from wf_mesh.testing import LocalCluster
from wf_mesh.viz import format_table

from _report import (  # benchmarks/ is on sys.path
    above,
    at_most,
    benchmark_parser,
    per_trial,
    ratio_row,
    report,
)
from _timing import compare_trials, timed_dist


class Flat(nn.Module):
    """``count`` parameters of ``numel`` elements, views of one flat buffer (so a single flat copy_ is possible)."""

    def __init__(self, count: int, numel: int, dtype=torch.float32) -> None:
        super().__init__()
        self.flat = torch.randn(count * numel).to(dtype)
        self.weights = nn.ParameterList(nn.Parameter(v) for v in self.flat.view(count, numel).unbind(0))


def ema_large(count: int, numel: int, iters: int, trials: int) -> dict[str, list[float]]:
    model = Flat(count, numel)
    src = list(model.parameters())
    ema = ShardedEMA(model, beta=0.999)
    targets = [torch.empty_like(p) for p in src]
    flat_target = torch.empty_like(model.flat)
    bare = [torch.empty_like(p) for p in src]
    half = Flat(count, numel, torch.bfloat16)
    half_ema = ShardedEMA(half, beta=0.999)
    with torch.no_grad():
        paths = {
            "copy_ (foreach)": lambda: _compat.foreach_copy_(targets, src),
            "copy_ (one flat)": lambda: flat_target.copy_(model.flat),
            "bare _foreach_lerp_": lambda: _compat.foreach_lerp_(bare, src, 0.001),
            "ShardedEMA.update": lambda: ema.update(model),
            "ShardedEMA.update (bf16 model)": lambda: half_ema.update(half),
        }
        return compare_trials(paths, iters, trials)


def ema_small(count: int, numel: int, iters: int, trials: int) -> dict[str, list[float]]:
    model = Flat(count, numel)
    src = list(model.parameters())
    ema = ShardedEMA(model, beta=0.999)
    loop_targets = [p.detach().clone() for p in src]
    copy_targets = [torch.empty_like(p) for p in src]

    def loop():
        for t, p in zip(loop_targets, src):
            t.lerp_(p, 0.001)

    with torch.no_grad():
        return compare_trials(
            {
                "copy_ (foreach)": lambda: _compat.foreach_copy_(copy_targets, src),
                "ShardedEMA.update": lambda: ema.update(model),
                "lerp_ loop": loop,
            },
            iters,
            trials,
        )


class ManySmall(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        for i in range(layers // 2):
            self.register_buffer(f"stat{i}", torch.randn(width))


def broadcast_paths(layers: int, width: int, iters: int, trials: int) -> dict:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    group = mesh.get_group("replicate")
    torch.manual_seed(dist.get_rank())
    model = ManySmall(layers, width)
    tensors = [t.detach() for t in [*model.parameters(), *model.buffers()]]
    buckets = broadcast_dtensor_model_states(model, mesh)
    values = torch.cat([t.reshape(-1).double() for t in tensors])
    low, high = values.clone(), values.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    assert torch.equal(low, high)  # the replicas, seeded differently, are identical after the broadcast

    def per_tensor():
        for t in tensors:
            dist.broadcast(t, group=group, group_src=0)

    times = compare_trials(
        {"bucketed": lambda: broadcast_dtensor_model_states(model, mesh), "per_tensor": per_tensor},
        iters,
        trials,
        timed_dist,
    )
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {
        **times,
        "tensors": len(tensors),
        "bytes": nbytes,
        "buckets": buckets,
        "collectives_bucketed": buckets + 1,
        "collectives_per_tensor": len(tensors),
    }


def med(samples: list[float]) -> float:
    return statistics.median(samples)


def ratio_rows(results: dict, quick: bool) -> list[dict]:
    big, small = results["ema_large"], results["ema_small"]
    copy_ = big["copy_ (foreach)"]
    rows = [
        ratio_row(
            "state",
            "EMA update / copy_ of the same bytes",
            per_trial(big["ShardedEMA.update"], copy_),
            at_most(1.10),
            quick=quick,
        ),
        ratio_row(
            "state",
            "bare _foreach_lerp_ / copy_ (the floor)",
            per_trial(big["bare _foreach_lerp_"], copy_),
            quick=quick,
        ),
        ratio_row(
            "state",
            "EMA update, bf16 model / copy_",
            per_trial(big["ShardedEMA.update (bf16 model)"], copy_),
            quick=quick,
        ),
        ratio_row(
            "state",
            "many small tensors: lerp_ loop / EMA update",
            per_trial(small["lerp_ loop"], small["ShardedEMA.update"]),
            quick=quick,
        ),
    ]
    for world, b in results["broadcast"].items():
        expected = b["buckets"] + 1  # one broadcast per bucket + the layout check
        rows.append(
            ratio_row(
                "state",
                f"state broadcast w{world}: collectives / (buckets + 1 check), {b['tensors']} tensors",
                b["collectives_bucketed"] / expected,
                at_most(1.0)._replace(text="≈ 1 (collectives ≈ buckets)"),
                quick=quick,
            )
        )
        rows.append(
            ratio_row(
                "state",
                f"state broadcast w{world}: time per-tensor / bucketed",
                per_trial(b["per_tensor"], b["bucketed"]),
                above(1, "> 1 (well ahead)"),
                quick=quick,
            )
        )
    return rows


def main() -> None:
    args = benchmark_parser(__doc__).parse_args()
    large = (16, 2**16) if args.quick else (100, 10**6)  # 1M or 100M fp32 parameters
    small = (500, 256) if args.quick else (5000, 1024)
    iters, trials = (2, 3) if args.quick else (3, 7)
    layers, width = (100, 16) if args.quick else (300, 32)
    worlds = (2,) if args.quick else (2, 4)
    print(
        f"# wf_mesh state benchmark  torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} threads ({'quick' if args.quick else 'full'}; medians of {trials} trials)"
    )
    results: dict = {"torch": torch.__version__, "cpus": os.cpu_count(), "quick": args.quick}

    count, numel = large
    r = results["ema_large"] = ema_large(count, numel, iters, trials)
    copy_ = med(r["copy_ (foreach)"])
    print(
        f"\n## EMA update, {count * numel / 1e6:.0f}M fp32 parameters in {count} tensors (ratio = time / foreach copy_)"
    )
    table = [[name, f"{med(t) * 1e3:.2f}", f"{med(t) / copy_:.2f}"] for name, t in r.items()]
    ema, bare = med(r["ShardedEMA.update"]), med(r["bare _foreach_lerp_"])
    table.append(["wrapper overhead vs bare lerp", f"{(ema - bare) * 1e3:.2f}", f"{ema / bare:.2f}"])
    print(format_table(["path", "ms", "ratio"], table, align="lrr"))

    count, numel = small
    r = results["ema_small"] = ema_small(count, numel, iters, trials)
    print(f"\n## EMA of many small tensors: {count} x {numel} fp32 (ratio = time / ShardedEMA.update)")
    ema = med(r["ShardedEMA.update"])
    table = [[name, f"{med(t) * 1e3:.2f}", f"{med(t) / ema:.2f}"] for name, t in r.items()]
    print(format_table(["path", "ms", "ratio"], table, align="lrr"))

    print(
        f"\n## state broadcast over a replicate axis (gloo): {layers} Linear({width}, {width}) + {layers // 2} buffers"
    )
    results["broadcast"] = {}
    table = []
    for world in worlds:
        cluster = LocalCluster(world).start()
        try:
            b = cluster.run(broadcast_paths, layers, width, iters * 3, trials)[0]
        finally:
            cluster.shutdown()
        results["broadcast"][world] = b
        bucketed, per_tensor = med(b["bucketed"]), med(b["per_tensor"])
        table.append(
            [
                world,
                b["tensors"],
                f"{b['bytes'] / 1024:.0f}",
                f"{bucketed * 1e3:.2f}",
                b["collectives_bucketed"],
                f"{per_tensor * 1e3:.2f}",
                b["collectives_per_tensor"],
                f"{per_tensor / bucketed:.1f}x",
            ]
        )
    head = ["world", "tensors", "KiB", "bucketed ms", "colls", "per-tensor ms", "colls", "speedup"]
    print(format_table(head, table, align="r" * len(head)))
    rows = ratio_rows(results, args.quick)
    print()
    report("state", args, rows, results)


if __name__ == "__main__":
    main()
