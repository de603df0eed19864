"""CP attention with mask plans (issue 19): load balance, what a ring skips, fwd+bwd time ring vs allgather.

Three world-model masks over one sequence of ``S`` tokens: block-causal (16 equal frame chunks), packed clips
(4 clips of different lengths, block-causal inside each, chunks of S/16) and a chunk window (16 chunks of
uneven sizes, each seeing the 3 chunks before it). At cp 4:

1. imbalance (max / mean unmasked pairs per rank) of the work-balanced plan (``plan_cp_attention(mask=...)``,
   target <= 1.10) and of contiguous ``torch.chunk`` shards (reported);
2. of the ring over the balanced plan and over contiguous shards: (query rank, K/V block) pairs skipped, K/V
   hops not sent, dK/dV messages not sent, each / all (:meth:`CPAttentionPlan.ring_skips`; exact counts,
   reported). The balanced plan spreads every rank's work over the whole sequence, so its ring rarely skips a
   block: balancing and skipping trade against each other, and the balance decides the step time;
3. fwd+bwd seconds (slowest rank, interleaved trials, local gloo processes, one thread per rank, fp32, GQA) of
   ring and allgather with the same mask plan side by side, and of the ring without a mask (full attention
   over the same shards): ratios ring / allgather and masked ring / full ring (reported: CPU timings on shared
   cores).

    python benchmarks/cp_attention_masks.py [--quick] [--json out.json]
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.attention import cp_attention
from wf_mesh.load_balance import TARGET, balance_by_work, contiguous_segments, imbalance, rank_work
from wf_mesh.ring_schedule import RingSkips, ring_needs
from wf_mesh.testing import LocalCluster

from _report import (  # benchmarks/ is on sys.path
    at_most,
    benchmark_parser,
    per_trial,
    ratio_row,
    report,
)
from _timing import compare_trials, timed_dist

CP = 4


def masks(s: int) -> dict[str, wf_mesh.RangeMask]:
    """The three masks over ``s`` tokens (``s`` divisible by 64)."""
    chunk = s // 16
    clips = [s * 23 // 64, s * 5 // 64, s * 14 // 64]
    window = [3, 5, 4, 6, 2, 5, 7, 4, 3, 5, 6, 4, 3, 2, 3, 2]  # sums to 64
    return {
        "block-causal": wf_mesh.RangeMask.block_causal([chunk] * 16),
        "packed": wf_mesh.RangeMask.packed([*clips, s - sum(clips)], causal="block", chunk_size=chunk),
        "windowed": wf_mesh.RangeMask.chunk_window([w * s // 64 for w in window], 3),
    }


def balance_rows(mask: wf_mesh.RangeMask) -> dict:
    """Imbalance of the balanced and the contiguous layout, and the balanced ring's skips (pure arithmetic)."""
    balanced = balance_by_work(mask, CP)
    contiguous = contiguous_segments(mask.seq_len, CP)
    return {
        "plan": imbalance(rank_work(mask, balanced)),
        "contiguous": imbalance(rank_work(mask, contiguous)),
        "skips": RingSkips.of(ring_needs(mask, balanced)).__dict__,
        "skips_contiguous": RingSkips.of(ring_needs(mask, contiguous)).__dict__,
        "segments": [len(s) for s in balanced],
    }


def bench_times(dims, iters: int, trials: int) -> dict:
    """Per mask, fwd+bwd seconds per trial of ring and allgather with its plan and of the unmasked ring."""
    b, h, hkv, s, d = dims
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(shape, generator=g) for shape in ((b, h, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, h, s, d))]
    out = {}
    for name, mask in masks(s).items():
        plan = wf_mesh.plan_cp_attention(mask=mask, mesh=pm)
        unmasked = wf_mesh.plan_cp_attention(seq_len=s, mesh=pm)
        q, k, v = (plan.shard(x, 2).clone().requires_grad_() for x in full[:3])
        dout = plan.shard(full[3], 2)
        # the same shards without the mask: the unmasked plan's lengths are torch.chunk's, so run it on
        # torch.chunk shards of the same sizes (full attention's cost does not depend on which tokens)
        uq, uk, uv = (unmasked.shard(x, 2).clone().requires_grad_() for x in full[:3])
        udout = unmasked.shard(full[3], 2)

        def step(method, q=q, k=k, v=v, dout=dout, plan=plan):
            q.grad = k.grad = v.grad = None
            cp_attention(q, k, v, layout="bhsd", method=method, plan=plan).backward(dout)

        def full_ring(q=uq, k=uk, v=uv, dout=udout, plan=unmasked):
            q.grad = k.grad = v.grad = None
            cp_attention(q, k, v, layout="bhsd", method="ring", plan=plan).backward(dout)

        paths = {"ring": lambda step=step: step("ring"), "allgather": lambda step=step: step("allgather")}
        out[name] = compare_trials({**paths, "ring, no mask": full_ring}, iters, trials, timed_dist)
    return out


def main() -> None:
    args = benchmark_parser(__doc__).parse_args()
    torch.set_num_threads(1)  # like every rank of the cluster
    dims = (1, 8, 4, 256, 32) if args.quick else (1, 8, 4, 2048, 64)  # B, H, Hkv, S, D
    iters, trials = (1, 3) if args.quick else (2, 5)
    s = dims[3]
    results: dict = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cp": CP,
        "dims": dict(zip(["B", "H", "Hkv", "S", "D"], dims)),
        "balance": {name: balance_rows(mask) for name, mask in masks(s).items()},
    }
    cluster = LocalCluster(CP).start()
    try:
        results["seconds"] = cluster.run(bench_times, dims, iters, trials)[0]
    finally:
        cluster.shutdown()

    rows = []

    def row(measurement, ratios, target=None):
        rows.append(ratio_row("cp_attention_masks", measurement, ratios, target, quick=args.quick))

    print(f"# wf_mesh CP attention with mask plans  torch {torch.__version__}, {os.cpu_count()} CPUs, gloo, cp {CP}")
    print(f"# (B, H, Hkv, S, D) = {dims} fp32; time = fwd+bwd, median of {trials} interleaved trials, slowest rank")
    print(
        f"{'mask':>13} {'plan':>6} {'contig':>7} {'blocks':>7} {'hops':>6} {'dK/dV':>6} {'ring ms':>8} {'allg ms':>8}"
    )
    for name, bal in results["balance"].items():
        sk, sec = bal["skips"], results["seconds"][name]
        row(f"cp {CP} {name}: imbalance, balanced plan (max / mean work)", bal["plan"], at_most(TARGET))
        row(f"cp {CP} {name}: imbalance, contiguous shards", bal["contiguous"])
        for layout, sk_of in (("balanced", sk), ("contiguous", bal["skips_contiguous"])):
            prefix = f"cp {CP} {name}, {layout}: ring"
            row(f"{prefix} blocks skipped / all", sk_of["blocks_skipped"] / sk_of["blocks"])
            row(f"{prefix} K/V hops skipped / all", sk_of["kv_hops_skipped"] / sk_of["kv_hops"])
            row(f"{prefix} dK/dV messages skipped / all", sk_of["dkv_messages_skipped"] / sk_of["dkv_messages"])
        row(f"cp {CP} {name}: ring / allgather, same mask, fwd+bwd time", per_trial(sec["ring"], sec["allgather"]))
        row(
            f"cp {CP} {name}: masked ring / ring without mask, fwd+bwd time",
            per_trial(sec["ring"], sec["ring, no mask"]),
        )
        print(
            f"{name:>13} {bal['plan']:>6.2f} {bal['contiguous']:>7.2f} "
            f"{sk['blocks_skipped']:>3}/{sk['blocks']:<3} {sk['kv_hops_skipped']:>2}/{sk['kv_hops']:<3} "
            f"{sk['dkv_messages_skipped']:>2}/{sk['dkv_messages']:<3} {statistics.median(sec['ring']) * 1e3:>8.1f} "
            f"{statistics.median(sec['allgather']) * 1e3:>8.1f}"
        )
    print()
    report("cp_attention_masks", args, rows, results)


if __name__ == "__main__":
    main()
