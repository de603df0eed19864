"""Shard-local state benchmark: EMA update vs a copy_ of the same bytes, foreach vs loop, bucketed broadcast.

Measures, in one run:
1. EMA update of ~100M float32 parameters (single process): ``ShardedEMA.update`` vs a ``copy_`` of the same
   bytes (``torch._foreach_copy_`` over the same tensors, and one flat ``copy_``), and vs a bare
   ``torch._foreach_lerp_`` (the floor our wrapper adds its per-call checks to); also a bf16 model (mul + add);
2. EMA of many small tensors: ``ShardedEMA.update`` (foreach) vs a Python loop of ``lerp_``;
3. ``broadcast_dtensor_model_states`` (bucketed) vs one ``dist.broadcast`` per tensor, on local gloo processes,
   for a model with hundreds of small parameters and buffers: time and number of collectives.
Each timing is the median over interleaved trials (the slowest rank for the broadcast). Design targets
(DESIGN.md section 7): EMA within 10% of copy_; broadcast collectives ~ buckets, well ahead of per-tensor.

    python benchmarks/state.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from _timing import compare, timed_dist  # benchmarks/ is on sys.path when a script runs

from wf_mesh.ema import ShardedEMA
from wf_mesh.state_sync import broadcast_dtensor_model_states
from wf_mesh.testing import LocalCluster


class Flat(nn.Module):
    """``count`` parameters of ``numel`` elements, views of one flat buffer (so a single flat copy_ is possible)."""

    def __init__(self, count: int, numel: int, dtype=torch.float32) -> None:
        super().__init__()
        self.flat = torch.randn(count * numel).to(dtype)
        self.weights = nn.ParameterList(nn.Parameter(v) for v in self.flat.view(count, numel).unbind(0))


def ema_large(count: int, numel: int, iters: int, trials: int) -> dict[str, float]:
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
            "copy_ (foreach)": lambda: torch._foreach_copy_(targets, src),
            "copy_ (one flat)": lambda: flat_target.copy_(model.flat),
            "bare _foreach_lerp_": lambda: torch._foreach_lerp_(bare, src, 0.001),
            "ShardedEMA.update": lambda: ema.update(model),
            "ShardedEMA.update (bf16 model)": lambda: half_ema.update(half),
        }
        return compare(paths, iters, trials)


def ema_small(count: int, numel: int, iters: int, trials: int) -> dict[str, float]:
    model = Flat(count, numel)
    src = list(model.parameters())
    ema = ShardedEMA(model, beta=0.999)
    loop_targets = [p.detach().clone() for p in src]
    copy_targets = [torch.empty_like(p) for p in src]

    def loop():
        for t, p in zip(loop_targets, src):
            t.lerp_(p, 0.001)

    with torch.no_grad():
        return compare(
            {
                "copy_ (foreach)": lambda: torch._foreach_copy_(copy_targets, src),
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

    times = compare(
        {"bucketed": lambda: broadcast_dtensor_model_states(model, mesh), "per_tensor": per_tensor},
        iters,
        trials,
        timed_dist,
    )
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {**times, "tensors": len(tensors), "bytes": nbytes, "buckets": buckets,
            "collectives_bucketed": buckets + 1, "collectives_per_tensor": len(tensors)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations (smoke test)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    large = (16, 2**18) if args.quick else (100, 10**6)  # 4M or 100M fp32 parameters
    small = (1000, 1024) if args.quick else (5000, 1024)
    iters, trials = (2, 3) if args.quick else (3, 7)
    layers, width = (100, 16) if args.quick else (300, 32)
    worlds = (2,) if args.quick else (2, 4)
    print(f"# wf_mesh state benchmark  torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} threads ({'quick' if args.quick else 'full'})")  # fmt: skip
    results: dict = {"torch": torch.__version__, "cpus": os.cpu_count(), "quick": args.quick}

    count, numel = large
    r = results["ema_large"] = ema_large(count, numel, iters, trials)
    copy_ = r["copy_ (foreach)"]
    print(
        f"\n## EMA update, {count * numel / 1e6:.0f}M fp32 parameters in {count} tensors (ratio = time / foreach copy_)"
    )
    print(f"{'path':<32} {'ms':>9} {'ratio':>6}")
    for name, t in r.items():
        print(f"{name:<32} {t * 1e3:>9.2f} {t / copy_:>6.2f}")
    print(f"{'wrapper overhead vs bare lerp':<32} {(r['ShardedEMA.update'] - r['bare _foreach_lerp_']) * 1e3:>9.2f} "
          f"{r['ShardedEMA.update'] / r['bare _foreach_lerp_']:>6.2f}")  # fmt: skip

    count, numel = small
    r = results["ema_small"] = ema_small(count, numel, iters, trials)
    print(f"\n## EMA of many small tensors: {count} x {numel} fp32 (ratio = time / ShardedEMA.update)")
    print(f"{'path':<32} {'ms':>9} {'ratio':>6}")
    for name, t in r.items():
        print(f"{name:<32} {t * 1e3:>9.2f} {t / r['ShardedEMA.update']:>6.2f}")

    print(
        f"\n## state broadcast over a replicate axis (gloo): {layers} Linear({width}, {width}) + {layers // 2} buffers"
    )
    print(f"{'world':>5} {'tensors':>8} {'KiB':>7} {'bucketed ms':>12} {'colls':>6} {'per-tensor ms':>14} {'colls':>6} "
          f"{'speedup':>8}")  # fmt: skip
    results["broadcast"] = {}
    for world in worlds:
        cluster = LocalCluster(world).start()
        try:
            b = cluster.run(broadcast_paths, layers, width, iters * 3, trials)[0]
        finally:
            cluster.shutdown()
        results["broadcast"][world] = b
        print(f"{world:>5} {b['tensors']:>8} {b['bytes'] / 1024:>7.0f} {b['bucketed'] * 1e3:>12.2f} "
              f"{b['collectives_bucketed']:>6} {b['per_tensor'] * 1e3:>14.2f} {b['collectives_per_tensor']:>6} "
              f"{b['per_tensor'] / b['bucketed']:>7.1f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
