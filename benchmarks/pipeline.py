"""Pipeline P2P benchmark: PPScheduler and PipelineP2P against raw ``dist.isend``/``dist.irecv``.

Two ranks on gloo (CPU), one pp=2 mesh, measured side by side in one run (methods interleaved, median of
the repeats). Each measurement is a ping-pong: rank 0 sends, rank 1 receives and sends it back.

- latency: round trip of a small tensor (4 float32, 16 bytes);
- bandwidth: round trip of an 8 MiB float32 tensor (16 MiB moved per round trip).

Methods: raw ``dist.isend``/``dist.irecv`` into a preallocated buffer; ``PPScheduler.isend_next`` /
``recv_prev_data`` (sends a copy, allocates the receive); ``PipelineP2P.send`` / ``recv`` (no copy,
allocates the receive); ``PipelineP2P.send`` / ``irecv_into`` (no copy, reused buffer, like raw);
``PipelineP2P(checked=True)`` (plus a 128-byte header per message).

    python benchmarks/pipeline.py            # about a minute on 2 cores
    python benchmarks/pipeline.py --quick    # smoke run, a few seconds
    python benchmarks/pipeline.py --json out.json   # also write the ratio rows and the times as JSON

Ratio rows (benchmarks/_report.py): each method's round-trip time / raw's, per repeat; median and spread.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh import PipelineP2P, PPScheduler
from wf_mesh.testing import LocalCluster
from wf_mesh.viz import format_table

from _report import (  # benchmarks/ is on sys.path
    benchmark_parser,
    format_rows,
    per_trial,
    ratio_row,
    write_json,
)

SMALL = 4  # float32 elements
BIG = 8 * 2**20 // 4  # 8 MiB of float32


def _methods():
    """name -> (send(tensor), recv(shape, dtype) -> tensor, finish()) on this rank."""
    mesh = wf_mesh.get_parallel_mesh()
    group, peer = mesh.group("pp"), mesh.ranks("pp")[1 - mesh.rank("pp")]
    raw_buffers: dict[tuple[int, ...], torch.Tensor] = {}
    raw_sends: list[dist.Work] = []

    def raw_send(t):
        raw_sends.append(dist.isend(t, peer, group=group))

    def raw_recv(shape, dtype):
        buf = raw_buffers.setdefault(tuple(shape), torch.empty(shape, dtype=dtype))
        dist.irecv(buf, peer, group=group).wait()
        return buf

    def raw_finish():
        while raw_sends:
            raw_sends.pop().wait()

    sched, link, checked = PPScheduler(), PipelineP2P(), PipelineP2P(checked=True)
    link_buffers: dict[tuple[int, ...], torch.Tensor] = {}

    def link_recv_into(shape, dtype):
        return link.irecv_into(link_buffers.setdefault(tuple(shape), torch.empty(shape, dtype=dtype))).wait()

    return {
        "raw dist.isend/irecv": (raw_send, raw_recv, raw_finish),
        "PPScheduler isend_next/recv_prev_data": (sched.isend_next, sched.recv_prev_data, sched.wait_sends),
        "PipelineP2P send/recv": (link.send, link.recv, link.wait_sends),
        "PipelineP2P send/irecv_into (reused buffer)": (link.send, link_recv_into, link.wait_sends),
        "PipelineP2P(checked=True) send/recv": (checked.send, checked.recv, checked.wait_sends),
    }


def bench(numel: int, iters: int, repeats: int) -> dict[str, list[float]] | None:
    """Seconds per round trip of a ``numel`` float32 tensor, per method and repeat (rank 0 returns them)."""
    wf_mesh.init_parallel(wf_mesh.ParallelDims(pp=2))
    methods = _methods()
    rank = dist.get_rank()
    x = torch.randn(numel)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for repeat in range(repeats + 1):  # repeat 0 warms up
        for name, (send, recv, finish) in methods.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                if rank == 0:
                    send(x)
                    y = recv(x.shape, x.dtype)
                else:
                    y = recv(x.shape, x.dtype)
                    send(y)
                finish()
            elapsed = time.perf_counter() - start
            if repeat:
                times[name].append(elapsed / iters)
    if rank == 0:
        assert torch.equal(y, x)
        return times
    return None


RAW = "raw dist.isend/irecv"
COMPARED = (
    ("PPScheduler", "PPScheduler isend_next/recv_prev_data"),
    ("PipelineP2P", "PipelineP2P send/recv"),
    ("PipelineP2P irecv_into", "PipelineP2P send/irecv_into (reused buffer)"),
    ("PipelineP2P checked", "PipelineP2P(checked=True) send/recv"),
)


def ratio_rows(times: dict[str, dict[str, list[float]]], quick: bool) -> list[dict]:
    rows = []
    for label, name in COMPARED:
        for size, what in (("small", f"{SMALL * 4} B"), ("big", f"{BIG * 4 // 2**20} MiB")):
            rows.append(
                ratio_row(
                    "pipeline",
                    f"{label} / raw isend+irecv, {what} round trip",
                    per_trial(times[size][name], times[size][RAW]),
                    quick=quick,
                )
            )
    return rows


def main() -> None:
    args = benchmark_parser(__doc__, quick="a few iterations only (smoke run)").parse_args()
    small_iters, big_iters, repeats = (20, 2, 2) if args.quick else (200, 5, 21)

    cluster = LocalCluster(2)
    try:
        small = cluster.run(bench, SMALL, small_iters, repeats)[0]
        big = cluster.run(bench, BIG, big_iters, repeats)[0]
    finally:
        cluster.shutdown()

    times = {"small": small, "big": big}
    med = {k: {name: statistics.median(v) for name, v in d.items()} for k, d in times.items()}
    print(
        f"pipeline P2P benchmark: 2 ranks, gloo, CPU, torch {torch.__version__}; "
        f"median of {repeats} interleaved repeat(s){' (--quick)' if args.quick else ''}"
    )
    print(f"latency: round trip of {SMALL * 4} B ({SMALL} float32), {small_iters} round trips per repeat")
    table = [[name, f"{t * 1e6:.1f}", f"{t / med['small'][RAW]:.2f}x"] for name, t in med["small"].items()]
    print(format_table(["method", "us", "vs raw"], table, align="lrr", indent="  "))
    print(f"bandwidth: round trip of 8 MiB float32 (16 MiB moved), {big_iters} round trips per repeat")
    table = [
        [name, f"{2 * BIG * 4 / t / 1e9:.2f}", f"{t * 1e3:.2f}", f"{t / med['big'][RAW]:.2f}x"]
        for name, t in med["big"].items()
    ]
    print(format_table(["method", "GB/s", "ms", "vs raw"], table, align="lrrr", indent="  "))
    rows = ratio_rows(times, args.quick)
    print()
    print(format_rows(rows))
    if args.json:
        result = {
            "torch": torch.__version__,
            "quick": args.quick,
            "repeats": repeats,
            "raw": RAW,
            "small_bytes": SMALL * 4,
            "big_bytes": BIG * 4,
            "seconds_per_round_trip": med,
            "per_repeat": times,
        }
        write_json(args.json, "pipeline", args.quick, rows, result)


if __name__ == "__main__":
    main()
