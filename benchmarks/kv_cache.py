"""KV-cache decoding (issue 19): KVCache.attend against all-gathering the cache, one layer call side by side.

Local gloo processes (CPU, one thread per rank) at cp 2 and cp 4; one attention layer, B=1, fp32, GQA; the
cache filled by prefill chunks to two sizes (the same new chunk length at both), then, at each size, a
denoising pass (``next_chunk(L, append=False)``: the cache stays as it is from call to call) timed three ways
in the same interleaved trials (slowest rank):

1. ``KVCache``: ``next_chunk`` (its one agreement per chunk; in a model every layer shares it, here the one
   layer carries it) and ``step.attend``: the chunk's queries all-gathered, every rank attends them to its
   cache shard, partial results back by one all-to-all and merged;
2. the baseline, built in this script from public pieces: every rank keeps the keys and values it appended
   (its cache shard) in a buffer of its own, writes its shard of the chunk's k, v after them, all-gathers the
   buffer (``dist.all_gather_single``: every rank then holds the whole cache) and attends its own
   queries to every key with the same kernel (``wf_mesh.attention_kernels.attend``, the kernel the cache
   chose; the gathered keys read as a strided view, no copy). Its outputs are checked equal to the cache's;
3. ``KVCache`` with fault containment on (``contain_faults=True``: one verdict exchange more per layer call).

Bytes sent per rank per layer call are counted from the c10d ops dispatched in ``step.attend`` and in the
baseline's all-gather (``cp_attention.Traffic``): the cache's traffic is the chunk's queries and partial
outputs, whatever the cache length; the baseline's is its cache shard.

    python benchmarks/kv_cache.py [--quick] [--json out.json]
"""

from __future__ import annotations

import os
import statistics
from functools import partial

import torch
import torch.distributed as dist
from cp_attention import Traffic

import wf_mesh
from wf_mesh import _compat, faults
from wf_mesh.attention_kernels import attend
from wf_mesh.testing import LocalCluster

from _report import (  # benchmarks/ is on sys.path
    at_most,
    below,
    benchmark_parser,
    equals,
    per_trial,
    ratio_row,
    report,
)
from _timing import compare_trials, timed_dist

PATHS = ("kvcache", "baseline", "kvcache contained")


class GatheredCache:
    """The baseline: this rank's cache shard in a buffer ``(rows, B, 2, Hkv, D)`` (k and v of a token side by
    side), all-gathered whole at every layer call."""

    def __init__(self, shards: list[tuple[torch.Tensor, torch.Tensor]], chunk_local: int, cache: wf_mesh.KVCache):
        self.cache = cache
        self.cached = sum(k.shape[2] for k, _ in shards)
        self.buffer = torch.empty(self.cached + chunk_local, cache.batch, 2, cache.kv_heads, cache.head_dim)
        row = 0
        for k, v in shards:  # (B, Hkv, s, D) each
            self.buffer[row : row + k.shape[2], :, 0] = k.permute(2, 0, 1, 3)
            self.buffer[row : row + k.shape[2], :, 1] = v.permute(2, 0, 1, 3)
            row += k.shape[2]
        n = dist.get_world_size()
        self.gathered = self.buffer.new_empty(n * self.buffer.shape[0], *self.buffer.shape[1:])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's queries against the whole cache and the whole chunk (every rank's shard of it)."""
        self.buffer[self.cached :, :, 0] = k.permute(2, 0, 1, 3)
        self.buffer[self.cached :, :, 1] = v.permute(2, 0, 1, 3)
        _compat.all_gather_single(self.gathered, self.buffer)
        keys, values = (self.gathered[:, :, i].permute(1, 2, 0, 3) for i in (0, 1))  # (B, Hkv, n * rows, D)
        return attend(q, keys, values, None, False, self.cache.scale, self.cache.kernel)[0]


def bench(dims, sizes: tuple[int, ...], chunk: int, prefill: int, iters: int, trials: int) -> dict:
    """At each cache size: seconds per trial of each path, bytes sent per layer call, cache lengths."""
    b, h, hkv, d = dims
    n = dist.get_world_size()
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=n))
    cache = wf_mesh.KVCache(
        mesh=pm, layers=1, batch=b, heads=h, kv_heads=hkv, head_dim=d, capacity=max(sizes) // n + chunk
    )
    torch.manual_seed(dist.get_rank())  # each rank's own tokens: the values do not matter, only the shapes
    shards: list[tuple[torch.Tensor, torch.Tensor]] = []
    out: dict = {}
    with torch.no_grad():
        for size in sizes:
            while cache.tokens < size:
                step = cache.next_chunk(min(prefill, size - cache.tokens))
                s = step.local_len
                k, v = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
                step.attend(0, torch.randn(b, h, s, d), k, v)
                shards.append((k, v))
            assert len(set(cache.lengths)) == 1, cache.lengths  # equal shards: the baseline gathers them unpadded
            local = chunk // n
            q, k, v = torch.randn(b, h, local, d), torch.randn(b, hkv, local, d), torch.randn(b, hkv, local, d)
            baseline = GatheredCache(shards, local, cache)

            def kv_call() -> torch.Tensor:
                step = cache.next_chunk(chunk, append=False)
                assert step.local_len == local
                return step.attend(0, q, k, v)

            def contained() -> torch.Tensor:  # every rank switches alike, in the same interleaved order
                faults.set_containment(True)
                try:
                    return kv_call()
                finally:
                    faults.set_containment(None)

            torch.testing.assert_close(kv_call(), baseline.attend(q, k, v), atol=1e-4, rtol=1e-4)
            paths = dict(zip(PATHS, (kv_call, partial(baseline.attend, q, k, v), contained)))
            seconds = compare_trials(paths, iters, trials, timed_dist)
            step = cache.next_chunk(chunk, append=False)  # its agreement is not a layer call's traffic
            sent = {}
            for name, call in (("kvcache", partial(step.attend, 0, q, k, v)), ("baseline", paths["baseline"])):
                traffic = Traffic(kv_numel=0)  # bytes sent only (no buffer counts as K/V)
                with traffic.mode:
                    call()
                sent[name] = traffic.sent
            out[size] = {"seconds": seconds, "sent": sent, "lengths": cache.lengths}
    return out


def main() -> None:
    args = benchmark_parser(__doc__).parse_args()
    torch.set_num_threads(1)  # like every rank of the cluster
    dims = (1, 8, 2, 32) if args.quick else (1, 8, 2, 64)  # B, H, Hkv, D
    sizes, chunk, prefill = ((256, 1024), 32, 256) if args.quick else ((4096, 16384), 256, 2048)
    iters, trials = (1, 3) if args.quick else (3, 11)
    results: dict = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "dtype": "float32",
        "dims": dict(zip(["B", "H", "Hkv", "D"], dims)),
        "cache_sizes": list(sizes),
        "chunk": chunk,
        "cp": {},
    }
    for n in (2, 4):
        cluster = LocalCluster(n).start()
        try:
            results["cp"][n] = cluster.run(bench, dims, sizes, chunk, prefill, iters, trials)[0]
        finally:
            cluster.shutdown()

    rows = []

    def row(measurement, ratios, target=None):
        rows.append(ratio_row("kv_cache", measurement, ratios, target, quick=args.quick))

    print(f"# wf_mesh KV-cache decoding  torch {torch.__version__}, {os.cpu_count()} CPUs, gloo, 1 thread per rank")
    print(
        f"# (B, H, Hkv, D) = {dims} fp32, chunk {chunk} tokens (append=False); time = one layer call, median of "
        f"{trials} interleaved trials, slowest rank"
    )
    print(
        f"{'cp':>3} {'cache':>7} {'KVCache ms':>10} {'baseline ms':>11} {'contained ms':>12} {'KiB sent':>9} {'base KiB':>9}"
    )
    for n, by_size in results["cp"].items():
        for size, run in by_size.items():
            sec, sent = run["seconds"], run["sent"]
            med = {name: statistics.median(s) * 1e3 for name, s in sec.items()}
            print(
                f"{n:>3} {size:>7} {med['kvcache']:>10.2f} {med['baseline']:>11.2f} {med['kvcache contained']:>12.2f} "
                f"{sent['kvcache'] / 1024:>9.1f} {sent['baseline'] / 1024:>9.1f}"
            )
            prefix = f"cp {n}, cache {size}, chunk {chunk}:"
            row(
                f"{prefix} KVCache.attend / all-gather-the-cache baseline, one layer call",
                per_trial(sec["kvcache"], sec["baseline"]),
                at_most(1.0),
            )
            row(
                f"{prefix} bytes sent per rank per layer call, KVCache / baseline",
                sent["kvcache"] / sent["baseline"],
                below(1),
            )
            row(
                f"{prefix} contain_faults=True / off, KVCache.attend",
                per_trial(sec["kvcache contained"], sec["kvcache"]),
                at_most(1.05),
            )
        small, large = (by_size[s]["sent"]["kvcache"] for s in sizes)
        row(
            f"cp {n}: KVCache bytes sent per layer call, cache {sizes[1]} / cache {sizes[0]}",
            large / small,
            equals(1.0, "= 1 (flat)"),
        )
    print()
    report("kv_cache", args, rows, results)


if __name__ == "__main__":
    main()
