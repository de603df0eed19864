"""CP attention benchmark: wf_mesh.cp_attention's ring / ulysses / usp vs the all-gather baseline, side by side.

Runs on local gloo processes (CPU, one thread per rank) at cp 2 and cp 4 (usp: 2 ring x 2 ulysses at cp 4;
at cp 2 it would be ring or ulysses), on a (B, H, S, D) fp32 problem with GQA (Hkv = H / 2), non-causal and
causal (causal with ``balance="zigzag"`` for every method). Per method:

1. seconds per forward+backward: median over interleaved trials of the slowest rank, as a ratio to allgather
   and to single-process SDPA (``F.scaled_dot_product_attention``, fwd+bwd) on the full sequence in this
   process with one thread. With more ranks than cores the ranks share cores: the ratio to SDPA is then
   an upper bound of what separate devices would see.
2. bytes sent per rank per forward+backward, counted from the c10d ops dispatched on the rank (a
   TorchDispatchMode): ``send``: the tensor; ``all_to_all``: the input minus the rank's own split;
   ``all_gather``: the input to each of the n-1 peers; ``reduce_scatter``: (n-1)/n of the input (the ops are
   seen through ``wf_mesh.testing.c10d_ops``: CommDebugMode does not see point-to-point ops). Against the
   theory (local shard sizes; kv = local k + v, q = local q, e = element bytes, U/R = ulysses/ring size):
   ring ``(n-1)kv`` fwd, ``(n-1)kv + n kv_fp32`` bwd (dK/dV travel in fp32); ulysses ``(2q+kv)(U-1)/U`` each
   way; usp the sum of both parts; allgather ``(n-1)kv`` fwd and bwd; plus the agreement's all-gather
   (``48 * 8 * (n-1)`` bytes) in forward.
3. peak extra K/V memory in forward: the live bytes of receive buffers holding K/V (tracked per storage, from
   the c10d call that fills it until it is freed), as a fraction of the full sequence's K/V; also what is
   still held after forward (saved for backward). Receive buffers of P2P and all-gather are K/V by
   construction; an all-to-all buffer counts as K/V when its size is a K/V head shard's (q and output shards
   are twice as large with Hkv = H / 2). Theory: ring min(2, n-1)/n (the block received last + the one in
   flight), ulysses 1/n, usp (1 + min(2, R-1))/n (the all-to-all output + ring blocks), allgather 1.

4. one plan per step and torch.compile (cp 4, every method, non-causal): fwd+bwd time of eager without a plan,
   eager with one and ``torch.compile(fullgraph=True, dynamic=False)`` with one (inductor; aot_eager with
   ``--quick``), side by side in the same trials; the graphs compiled over 3 steps that each build a new plan
   (target 1); collectives and host syncs per layer per step with and without a plan (targets: the data
   collectives only and 0 host syncs with a plan; the agreement's all-gather and its ``.tolist()`` more
   without); the peak bytes one planned fwd+bwd allocates (live storages of every op output, tracked by a
   dispatch mode: the CPU flash kernel's workspace is not seen) against one fp32 ``(B, H, S_local, D)`` shard,
   and the growth of that peak when S_local doubles (linear: 2; a kernel holding ``S_local^2`` scores: 4).

Ratio rows (benchmarks/_report.py): time per trial / allgather in the same trial, and / the median
single-process SDPA (no target: CPU timings on shared cores are reported only); bytes sent / theory and peak
K/V / the full K/V, with the theory as the target (exact counts).

    python benchmarks/cp_attention.py [--quick] [--json out.json]
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import weakref
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import wf_mesh
from wf_mesh import agreement, faults
from wf_mesh.agreement import ROW
from wf_mesh.attention import cp_attention, zigzag_shard
from wf_mesh.testing import LocalCluster, c10d_ops, counting_backend, dispatched, host_syncs

from _report import (  # benchmarks/ is on sys.path
    at_most,
    below,
    benchmark_parser,
    equals,
    per_trial,
    ratio_row,
    report,
)
from _timing import compare_trials, timed_dist, timed_local

METHODS = ("allgather", "ring", "ulysses", "usp")


class Traffic:
    """Bytes this rank sends through c10d ops, and the live receive buffers (K/V ones separately), while
    ``with traffic.mode:`` is active."""

    def __init__(self, kv_numel: int) -> None:
        self.kv_numel = kv_numel
        self.sent = 0
        self.live: dict[int, tuple[int, bool]] = {}
        self.kv_bytes = self.all_bytes = self.kv_peak = self.all_peak = 0
        self.mode = c10d_ops(self._on_op)

    def _on_op(self, name: str, args: tuple) -> None:
        if name == "send":
            self.sent += sum(t.nbytes for t in args[0])
        elif name == "recv_":
            for t in args[0]:
                self._track(t, True)
        elif name == "alltoall_base_":
            out, inp, pg, _, in_splits = args[:5]
            group = dist.ProcessGroup.unbox(pg)
            rows = inp.shape[0]
            own = in_splits[group.rank()] if in_splits else rows // group.size()
            self.sent += (rows - own) * (inp.nbytes // rows if rows else 0)
            self._track(out, out.numel() == self.kv_numel)
        elif name in ("_allgather_base_", "_reduce_scatter_base_"):
            out, inp, pg = args[:3]
            n = dist.ProcessGroup.unbox(pg).size()
            self.sent += inp.nbytes * (n - 1) // (n if name == "_reduce_scatter_base_" else 1)
            if out.is_floating_point():  # not the agreement's int64 row
                self._track(out, name == "_allgather_base_")

    def _track(self, t: torch.Tensor, kv: bool) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = (storage.nbytes(), kv)
        self.all_bytes += storage.nbytes()
        self.kv_bytes += storage.nbytes() if kv else 0
        self.all_peak, self.kv_peak = max(self.all_peak, self.all_bytes), max(self.kv_peak, self.kv_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        nbytes, kv = self.live.pop(key)
        self.all_bytes -= nbytes
        self.kv_bytes -= nbytes if kv else 0


def sample(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def method_meshes(n: int):
    """The cp mesh over all ``n`` ranks and each method's mesh (usp: a 2-D (n/2, 2) mesh, from 4 ranks on)."""
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=n))
    meshes = {"allgather": pm, "ring": pm, "ulysses": pm}
    if n >= 4:
        meshes["usp"] = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("cp_ring", "cp_ulysses"))
    return pm, meshes


@dataclasses.dataclass(frozen=True)
class _NoFacts(agreement.Facts):
    """An agreement exchange carrying nothing (what a close used to exchange)."""


CLOSES_TIMED = 10
"""Calls' worth of closing exchanges timed at once (one close is too short to time alone)."""


def bench_methods(dims: tuple[int, int, int, int, int], causal: bool, iters: int, trials: int) -> dict:
    b, h, hkv, s, d = dims
    n = dist.get_world_size()
    pm, meshes = method_meshes(n)
    balance = "zigzag" if causal else None

    def shard(x):
        return zigzag_shard(x, 2, mesh=pm) if causal else wf_mesh.shard_sequence(x, 2, mesh=pm, as_dtensor=False)

    shapes = [(b, h, s, d), (b, hkv, s, d), (b, hkv, s, d)]
    q, k, v = (shard(sample(shape, seed)).requires_grad_() for seed, shape in enumerate(shapes))
    dout = shard(sample((b, h, s, d), 3))

    def step(method):
        q.grad = k.grad = v.grad = None
        out = cp_attention(q, k, v, layout="bhsd", method=method, mesh=meshes[method], causal=causal, balance=balance)
        out.backward(dout)
        return out

    reference = step("allgather").detach()
    for method in meshes:
        assert torch.allclose(step(method), reference, atol=1e-4), method
    seconds = compare_trials({m: partial(step, m) for m in meshes}, iters, trials, timed_dist)

    def contained(method):  # every rank switches alike, in the same interleaved order
        faults.set_containment(True)
        try:
            return step(method)
        finally:
            faults.set_containment(None)

    contain = compare_trials(
        {f"{m}{side}": partial(contained if side else step, m) for m in meshes for side in ("", " contained")},
        iters,
        trials,
        timed_dist,
    )

    # what containment adds to a call that succeeds is its closing exchanges (one in forward, one in backward;
    # the steps' try/except costs nothing measurable): timed alone, many at a time, against the call itself
    def closes():  # CLOSES_TIMED times the two closes of one call
        faults.set_containment(True)
        try:
            for _ in range(2 * CLOSES_TIMED):
                faults.FaultSequence(pm.group("cp"), "cp_attention").close()
        finally:
            faults.set_containment(None)

    word, group = torch.zeros(1, dtype=torch.int64), pm.group("cp")

    def bare():  # the backend's latency floor: as many one-word all-reduces (what a close issues)
        for _ in range(2 * CLOSES_TIMED):
            dist.all_reduce(word, op=dist.ReduceOp.MAX, group=group)

    def rows():  # as many agreement exchanges (the all-gather of one ROW per rank a close used to be)
        for _ in range(2 * CLOSES_TIMED):
            agreement.agree(group, _NoFacts, what="cp_attention", required=True)

    paths = {"closes": closes, "bare": bare, "rows": rows, "ring": partial(step, "ring")}
    close_cost = compare_trials(paths, iters, trials, timed_dist)
    traffic = {}
    for method, mesh in meshes.items():
        q.grad = k.grad = v.grad = None
        fwd = Traffic(kv_numel=k.numel())
        with fwd.mode:
            out = cp_attention(q, k, v, layout="bhsd", method=method, mesh=mesh, causal=causal, balance=balance)
        held = fwd.kv_bytes
        bwd = Traffic(kv_numel=k.numel())
        with bwd.mode:
            out.backward(dout)
        traffic[method] = {
            "sent_fwd": fwd.sent,
            "sent_bwd": bwd.sent,
            "kv_peak_fwd": fwd.kv_peak,
            "kv_held_after_fwd": held,
            "inbound_peak_bwd": bwd.all_peak,
        }
    return {"seconds": seconds, "contain": contain, "close_cost": close_cost, "traffic": traffic}


class LiveBytes:
    """Peak bytes of the tensors ops create while ``with live.mode:`` is active (per storage, from the op that
    returns it until it is freed): what a call allocates on top of its inputs. Kernel-internal workspaces are
    not op outputs and are not seen."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.mode = dispatched(self._on_op)

    def _on_op(self, outputs) -> None:
        for t in outputs:
            storage = t.untyped_storage()
            if id(storage) in self.live or not storage.nbytes():
                continue
            self.live[id(storage)] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, id(storage))

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)


def step_counts(fn) -> dict[str, int]:
    """Collectives (c10d ops other than send/recv), P2P ops, agreement exchanges (int64 all-gathers, each read
    back with ``.tolist()``: a host sync) and dispatched host syncs of one ``fn()``."""
    counts = collections.Counter()

    def on_op(name, args):
        if name in ("send", "recv_"):
            counts["p2p"] += 1
            return
        counts["collectives"] += 1
        if name == "_allgather_base_" and args[0].dtype == torch.int64:
            counts["agreements"] += 1

    with c10d_ops(on_op), host_syncs(lambda what: counts.update(["dispatched_syncs"])):
        fn()
    counts["host_syncs"] = counts["agreements"] + counts["dispatched_syncs"]
    return {k: counts[k] for k in ("collectives", "p2p", "agreements", "host_syncs")}


def bench_plan_compile(dims, iters: int, trials: int, backend: str, steps: int = 3) -> dict:
    """Per method at this cp size: fwd+bwd seconds of eager without a plan, eager with one and compiled with one
    (``torch.compile(fullgraph=True, dynamic=False)``), the graphs compiled over ``steps`` steps (a new plan
    each), the counts per call with and without a plan, and the peak bytes one planned call allocates."""
    b, h, hkv, s, d = dims
    n = dist.get_world_size()
    pm, meshes = method_meshes(n)
    shapes = [(b, h, s, d), (b, hkv, s, d), (b, hkv, s, d)]
    q, k, v = (wf_mesh.shard_sequence(sample(x, i), 2, mesh=pm).requires_grad_() for i, x in enumerate(shapes))
    dout = wf_mesh.shard_sequence(sample((b, h, s, d), 3), 2, mesh=pm)
    out = {}
    for method, mesh in meshes.items():
        plans = [wf_mesh.plan_cp_attention(seq_len=s, mesh=mesh) for _ in range(steps)]

        def attend(q, k, v, plan, method=method, mesh=mesh):
            return cp_attention(
                q, k, v, method=method, mesh=None if plan is not None else mesh, layout="bhsd", plan=plan
            )

        counting, graphs = counting_backend(backend)
        compiled = torch.compile(attend, fullgraph=True, dynamic=False, backend=counting)

        def step(fn, plan, step=0):
            q.grad = k.grad = v.grad = None
            fn(q, k, v, plans[step] if plan else None).backward(dout)

        for i in range(steps):
            step(compiled, True, i)
        paths = {"planless": partial(step, attend, False), "plan": partial(step, attend, True)}
        paths["compiled"] = partial(step, compiled, True)
        seconds = compare_trials(paths, iters, trials, timed_dist)
        out[method] = {
            "seconds": seconds,
            "graphs": len(graphs),
            "counts_plan": step_counts(partial(step, attend, True)),
            "counts_planless": step_counts(partial(step, attend, False)),
            "peak_bytes": peak_bytes(dims, method, mesh, pm),
            "peak_bytes_2x": peak_bytes((b, h, hkv, 2 * s, d), method, mesh, pm),
            "local_len": q.shape[2],
        }
    return out


def peak_bytes(dims, method: str, mesh, pm) -> int:
    """Peak live bytes the tensors of one planned fwd+bwd take (:class:`LiveBytes`), inputs not counted."""
    b, h, hkv, s, d = dims
    shapes = [(b, h, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, h, s, d)]
    q, k, v, dout = (wf_mesh.shard_sequence(sample(x, i), 2, mesh=pm) for i, x in enumerate(shapes))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    plan = wf_mesh.plan_cp_attention(seq_len=s, mesh=mesh)
    live = LiveBytes()
    with live.mode:
        cp_attention(q, k, v, method=method, layout="bhsd", plan=plan).backward(dout)
    return live.peak


def sdpa_seconds(dims, causal: bool, iters: int, trials: int) -> list[float]:
    b, h, hkv, s, d = dims
    shapes = [(b, h, s, d), (b, hkv, s, d), (b, hkv, s, d)]
    q, k, v = (sample(shape, seed).requires_grad_() for seed, shape in enumerate(shapes))
    dout = sample((b, h, s, d), 3)

    def step():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(dout)

    step()
    return [timed_local(step, iters) for _ in range(trials)]


def theory(method: str, dims, n: int, elem: int = 4) -> dict[str, float]:
    """Bytes one rank must send (fwd, bwd) and the peak K/V it holds as a fraction of the full K/V."""
    b, h, hkv, s, d = dims
    local = s // n
    q, kv, kv32 = b * h * local * d * elem, 2 * b * hkv * local * d * elem, 2 * b * hkv * local * d * 4
    agree = ROW * 8 * (n - 1)
    ring, uly = {"allgather": (1, 1), "ring": (n, 1), "ulysses": (1, n), "usp": (n // 2, 2)}[method]
    if method == "allgather":
        return {"fwd": agree + (n - 1) * kv, "bwd": (n - 1) * kv, "kv_peak": 1.0, "kv_peak_text": "= 1"}
    a2a = (2 * q + kv) * (uly - 1) / uly
    fwd = agree + a2a + (ring - 1) * kv
    bwd = a2a + ((ring - 1) * kv + ring * kv32 if ring > 1 else 0)
    blocks = (uly > 1) + min(2, ring - 1)  # the all-to-all output; the received ring blocks
    return {"fwd": fwd, "bwd": bwd, "kv_peak": blocks / n, "kv_peak_text": f"= {blocks}/{n}"}


PLANNED_COLLECTIVES = {"ring": 0, "ulysses": 8, "usp": 8, "allgather": 2}
"""Collectives of one planned fwd+bwd per method (P2P not counted): the data moves only."""


def print_plan_compile(runs: dict, dims, n: int, backend: str, row) -> None:
    """The plan / compile table and its rows (see :func:`bench_plan_compile`)."""
    b, h, _, _, d = dims
    print(
        f"\n## cp {n}, non-causal: one plan per step, torch.compile(fullgraph=True, dynamic=False, backend={backend!r})"
    )
    print(
        f"{'method':>9} {'planless ms':>11} {'plan ms':>8} {'compiled ms':>11} {'compiled/eager':>14} {'graphs':>6} "
        f"{'coll. plan/none':>15} {'syncs plan/none':>15} {'peak MiB':>9} {'/ q fp32':>8} {'/ scores':>8}"
    )
    for method, run in runs.items():
        sec = {path: statistics.median(samples) for path, samples in run["seconds"].items()}
        plan, none = run["counts_plan"], run["counts_planless"]
        s_local = run["local_len"]
        q_bytes, scores = b * h * s_local * d * 4, b * h * s_local * s_local * 4
        print(
            f"{method:>9} {sec['planless'] * 1e3:>11.1f} {sec['plan'] * 1e3:>8.1f} {sec['compiled'] * 1e3:>11.1f} "
            f"{sec['compiled'] / sec['plan']:>14.2f} {run['graphs']:>6} "
            f"{plan['collectives']:>7}/{none['collectives']:<7} {plan['host_syncs']:>7}/{none['host_syncs']:<7} "
            f"{run['peak_bytes'] / 2**20:>9.2f} {run['peak_bytes'] / q_bytes:>8.2f} {run['peak_bytes'] / scores:>8.3f}"
        )
        prefix = f"cp {n}: {method}"
        row(
            f"{prefix} compiled / eager (both planned), fwd+bwd time",
            per_trial(run["seconds"]["compiled"], run["seconds"]["plan"]),
        )
        row(
            f"{prefix} eager with a plan / without, fwd+bwd time",
            per_trial(run["seconds"]["plan"], run["seconds"]["planless"]),
        )
        row(f"{prefix} with a plan: host syncs per layer per step", plan["host_syncs"], equals(0, "= 0"))
        row(f"{prefix} without a plan: host syncs per layer per step", none["host_syncs"])
        expected = PLANNED_COLLECTIVES[method]
        row(
            f"{prefix} with a plan: collectives per layer per step",
            plan["collectives"],
            equals(expected, f"= {expected}"),
        )
        row(
            f"{prefix} without a plan: collectives per layer per step",
            none["collectives"],
            equals(expected + 1, f"= {expected + 1}"),
        )
        row(f"{prefix} compiled: graphs over 3 steps (a new plan each)", run["graphs"], equals(1, "= 1"))
        row(f"{prefix}: peak bytes allocated by one fwd+bwd / fp32 (B, H, S_local, D)", run["peak_bytes"] / q_bytes)
        row(
            f"{prefix}: peak bytes of one fwd+bwd at 2 S_local / at S_local",
            run["peak_bytes_2x"] / run["peak_bytes"],
            below(3, "< 3 (linear 2)"),
        )
    print(
        "coll. = collectives per fwd+bwd (P2P hops not counted); syncs = agreement exchanges (their .tolist()) + "
        "dispatched .item()/device-to-host copies (planless usp: also DeviceMesh slicing's .item() on the CPU mesh tensor, not a device sync); peak = live bytes of the tensors one planned fwd+bwd creates "
        "(a dispatch mode tracking storages; kernel workspaces unseen), against one fp32 q shard and the "
        "S_local^2 fp32 scores a math kernel would hold"
    )


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of the compiled rows (default: inductor; aot_eager with --quick)",
    )
    args = parser.parse_args()
    backend = args.compile_backend or ("aot_eager" if args.quick else "inductor")
    torch.set_num_threads(1)  # like every rank of the cluster
    dims = (1, 8, 4, 256, 32) if args.quick else (1, 8, 4, 2048, 64)  # B, H, Hkv, S, D (Hkv divisible by U)
    iters, trials = (1, 3) if args.quick else (2, 5)
    b, _, hkv, s, d = dims
    full_kv = 2 * b * hkv * s * d * 4
    results: dict = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "dtype": "float32",
        "full_kv_bytes": full_kv,
        "dims": dict(zip(["B", "H", "Hkv", "S", "D"], dims)),
        "sdpa_seconds": {},
        "cp": {},
    }
    for causal in (False, True):
        results["sdpa_seconds"]["causal" if causal else "full"] = sdpa_seconds(dims, causal, iters, trials)
    for n in (2, 4):
        cluster = LocalCluster(n).start()
        try:
            results["cp"][n] = {
                "causal" if causal else "full": cluster.run(bench_methods, dims, causal, iters, trials)[0]
                for causal in (False, True)
            }
        finally:
            cluster.shutdown()

    cluster = LocalCluster(4).start()
    try:
        results["plan_compile"] = cluster.run(bench_plan_compile, dims, iters, trials, backend)[0]
    finally:
        cluster.shutdown()
    results["compile_backend"] = backend

    rows = []

    def row(measurement, ratios, target=None):
        rows.append(ratio_row("cp_attention", measurement, ratios, target, quick=args.quick))

    print(
        f"# wf_mesh CP attention benchmark  torch {torch.__version__}, {os.cpu_count()} CPUs, gloo, 1 thread per rank"
    )
    print(f"# (B, H, Hkv, S, D) = {dims} fp32; time = fwd+bwd, median of {trials} interleaved trials, slowest rank")
    for n, modes in results["cp"].items():
        for mode, run in modes.items():
            sdpa = statistics.median(results["sdpa_seconds"][mode])
            times, base = run["seconds"], run["seconds"]["allgather"]
            print(
                f"\n## cp {n}, {'causal (zigzag shards)' if mode == 'causal' else 'non-causal'}: single-process SDPA "
                f"{sdpa * 1e3:.1f} ms; K/V of the full sequence {full_kv / 2**20:.2f} MiB"
            )
            print(
                f"{'method':>9} {'ms':>8} {'/allgather':>10} {'/sdpa':>6} {'MiB sent':>9} {'/theory':>8} "
                f"{'peak K/V fwd':>13} {'theory':>7} {'held':>6} {'bwd inbound':>12}"
            )
            for method, samples in times.items():
                t, th = run["traffic"][method], theory(method, dims, n)
                sent, sent_theory = t["sent_fwd"] + t["sent_bwd"], th["fwd"] + th["bwd"]
                sec = statistics.median(samples)
                print(
                    f"{method:>9} {sec * 1e3:>8.1f} {sec / statistics.median(base):>10.2f} {sec / sdpa:>6.2f} "
                    f"{sent / 2**20:>9.2f} {sent / sent_theory:>8.3f} {t['kv_peak_fwd'] / full_kv:>13.3f} "
                    f"{th['kv_peak']:>7.3f} {t['kv_held_after_fwd'] / full_kv:>6.3f} "
                    f"{t['inbound_peak_bwd'] / full_kv:>12.3f}"
                )
                t["theory"] = th
                prefix = f"cp {n} {mode}: {method}"
                if method != "allgather":
                    row(f"{prefix} / allgather, fwd+bwd time", per_trial(samples, base))
                on, off = run["contain"][f"{method} contained"], run["contain"][method]
                row(f"{prefix}: contain_faults=True / off, fwd+bwd time", per_trial(on, off), at_most(1.02))
                if method == "ring":  # the same two closes for every method: one row per cp size and mode
                    cost = run["close_cost"]
                    row(
                        f"cp {n} {mode}: contain_faults=True's two closing exchanges / ring fwd+bwd time",
                        [x / CLOSES_TIMED for x in per_trial(cost["closes"], cost["ring"])],
                        at_most(0.02),
                    )
                    row(
                        f"cp {n} {mode}: a closing exchange / a bare one-word all-reduce (the backend's latency)",
                        per_trial(cost["closes"], cost["bare"]),
                    )
                    row(
                        f"cp {n} {mode}: a closing exchange / an agreement exchange (ROW-word all-gather)",
                        per_trial(cost["closes"], cost["rows"]),
                    )
                row(f"{prefix} / single-process SDPA, fwd+bwd time", [x / sdpa for x in samples])
                if mode == "full":  # bytes and memory are the same with causal
                    row(f"{prefix}: bytes sent per rank / theory", sent / sent_theory, equals(1.0, "= 1"))
                    row(
                        f"{prefix}: peak extra K/V in forward / full K/V",
                        t["kv_peak_fwd"] / full_kv,
                        equals(th["kv_peak"], th["kv_peak_text"]),
                    )
    print_plan_compile(results["plan_compile"], dims, 4, backend, row)
    print(
        "\npeak K/V fwd / held / bwd inbound: fractions of the full sequence's K/V (held = kept for backward;"
        " bwd inbound = every receive buffer in backward, fp32 dK/dV included)\n"
    )
    report("cp_attention", args, rows, results)


if __name__ == "__main__":
    main()
