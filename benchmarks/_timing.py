"""Timing helpers shared by the benchmark scripts: interleaved trials, medians, slowest-rank times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["compare", "compare_trials", "timed_dist", "timed_local"]


def timed_local(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``fn`` in this process."""
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def timed_dist(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of a collective ``fn``: ranks start together; the slowest rank's time."""
    dist.barrier()
    elapsed = torch.tensor([timed_local(fn, iters)])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def compare_trials(
    paths: dict[str, Callable[[], object]], iters: int, trials: int, timed=timed_local
) -> dict[str, list[float]]:
    """Seconds per call of each path in every trial, trials interleaved so that machine noise hits all paths
    alike (trial ``i`` of two paths can be divided: ``_report.per_trial``)."""
    for fn in paths.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(trials):
        for name, fn in paths.items():
            samples[name].append(timed(fn, iters))
    return samples


def compare(paths: dict[str, Callable[[], object]], iters: int, trials: int, timed=timed_local) -> dict[str, float]:
    """Median seconds per call of each path (:func:`compare_trials`, reduced)."""
    return {name: statistics.median(s) for name, s in compare_trials(paths, iters, trials, timed).items()}
