"""Helpers shared by the test modules (importable by the cluster's workers too: tests/ is on their path)."""

from __future__ import annotations

import enum
import os
import re
import time

import torch

USP = ("cp_ring", "cp_ulysses")
"""The dim names of the 2-D ``(ring, ulysses)`` DeviceMesh the usp cases build."""


def run_cp_cases(run_case, cases):
    """On every rank of a cp-only mesh: ``run_case(case, pm, usp_meshes)`` for each case (one mesh per usp split,
    built once), so that a whole matrix of cases runs in one ``run_distributed`` call."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import wf_mesh

    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    splits = sorted({c.usp for c in cases if c.usp})
    usp_meshes = {s: init_device_mesh("cpu", s, mesh_dim_names=USP) for s in splits}
    return [run_case(case, pm, usp_meshes) for case in cases]


def sample(shape, seed=0, dtype=torch.float32):
    """The same pseudo-random tensor on every rank (its own generator: the global RNG is left alone)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def caught(fn, fault) -> tuple[tuple[str, str], float]:
    """Run ``fn`` inside the context manager ``fault`` (an injected fault or a null context): ``((exception
    type name, message) or ("returned", ""), seconds it took)``."""
    start = time.monotonic()
    try:
        with fault:
            fn()
        outcome = ("returned", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    return outcome, time.monotonic() - start


def raised_everywhere(outcomes, error, match):
    """Assert that every rank's outcome (``run_distributed(..., return_exceptions=True)``) is an ``error``
    whose message matches the regex ``match``; return the messages."""
    messages = []
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, error), f"rank {rank}: expected {error.__name__}, got {outcome!r}"
        assert re.search(match, str(outcome)), f"rank {rank}: {str(outcome)!r} does not match {match!r}"
        messages.append(str(outcome))
    return messages


class DataType(str, enum.Enum):  # noqa: UP042 (the (str, Enum) form real world-model code uses)
    """A str-Enum like the conditioners of real world-model code broadcast."""

    VIDEO = "video"
    IMAGE = "image"


class Opaque:
    """An object only pickle can carry."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.value == self.value


def exec_block(source: str, name: str = "<README block>") -> None:
    """Run a README code block as a script (its asserts check what its comments claim)."""
    exec(compile(source, name, "exec"), {"__name__": "__main__"})


def expand(listing: str) -> list[int]:
    """A rank list as the views print it (uncut), e.g. "[0-3,8,9]", back to ranks."""
    ranks = []
    for part in listing.strip("[]").split(","):
        a, _, b = part.partition("-")
        ranks += range(int(a), int(b or a) + 1)
    return ranks


def listed_groups(text: str) -> dict[str, list[list[int]]]:
    """The groups of every axis in a view's group list (the rows after 'axis  groups  size  groups')."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["axis", "groups", "size"])
    return {line.split()[0]: [expand(g) for g in re.findall(r"\d+=(\[[\d,-]+\])", line)] for line in lines[start + 1 :]}


MARKER = "WF_MESH_TEST_MARKER"
"""Environment variable that tests put on the processes they start, to find every descendant later."""


def marked(marker: str) -> list[int]:
    """Live processes whose environment carries ``MARKER=marker``."""
    entry, found = f"{MARKER}={marker}".encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found
