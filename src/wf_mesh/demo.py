"""The demo ``wf-mesh demo`` runs on every rank: the mesh, CP on a video latent, FSDP2 + EMA, the pipeline ring.

Run it under torch's launcher (``wf-mesh demo --nproc 4 --tp 2 --cp 2`` does this for you, and shows the
workers' progress while they start)::

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m wf_mesh.demo --tp 2 --cp 2

``wf-mesh demo`` runs the launcher as ``python -m wf_mesh.demo launch <torchrun arguments>`` (:func:`launch`:
torchrun in-process, a failed worker reported in one line, and an exit that skips the interpreter's slow
teardown of torch). Each worker records how far it got (:data:`wf_mesh.cli.STAGES`) in the folder named by
``WF_MESH_DEMO_PROGRESS``, which ``wf-mesh demo`` watches.

The demo is a list of checks (:data:`CHECKS`). Each is a module-level function of a :class:`DemoContext` that
every rank calls collectively and that returns a :class:`CheckResult` (what it measured on this rank, as
named fields, and a one-line summary), raises :class:`CheckSkipped` (nothing to show at these degrees) or
raises :class:`CheckFailed`. Every distributed result is compared with the same computation done in one
process on the rank. After each check the ranks exchange outcomes (:class:`Outcome`), so all of them agree;
rank 0 prints progress, one timed line per check, then ``demo OK: ...`` (:func:`format_summary`: the checks that
passed and were skipped, and the times). The workers start through
:func:`wf_mesh.init_from_env` (gloo, CPU) and leave through its session. Any failure is printed (on
rank 0, naming the ranks) and every rank exits with code 1. From a notebook, on a running mesh::

    ctx = DemoContext.from_mesh(wf_mesh.get_parallel_mesh())
    outcomes = run_checks(ctx, echo=print if ctx.rank == 0 else None)   # outcomes[i].result: what it measured
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from wf_mesh.cli import add_degree_flags, dims_from_args
from wf_mesh.topology import FSDP_AXIS, ParallelDims
from wf_mesh.viz import format_ranks, format_table, mesh_axes, plural

if TYPE_CHECKING:
    import torch

    from wf_mesh.bootstrap import DistributedSession
    from wf_mesh.mesh import ParallelMesh

# torch is imported when a check runs (or by main, after telling `wf-mesh demo` that this worker started):
# importing it takes seconds, and the launcher shows the workers' progress meanwhile.

__all__ = [
    "CHECKS",
    "AllReduceResult",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "DemoContext",
    "FsdpEmaResult",
    "Outcome",
    "PipelineRingResult",
    "TopologyResult",
    "VideoSplitResult",
    "check_all_reduce",
    "check_cp_video_split",
    "check_fsdp_ema",
    "check_pipeline_ring",
    "check_topology",
    "format_report",
    "format_summary",
    "fsdp_batch",
    "main",
    "run_checks",
    "tiny_mlp",
    "video_inputs",
]

TIMEOUT_MINUTES = 5

_STARTED = time.monotonic()  # this module is the first thing a worker runs: its time alive includes torch's import


class CheckFailed(Exception):
    """A demo check found a wrong result on this rank."""


class CheckSkipped(Exception):
    """A demo check has nothing to show at these degrees (its message says why)."""


@dataclasses.dataclass(frozen=True)
class DemoContext:
    """What every check gets: the mesh, the plan it must match, and this rank."""

    mesh: ParallelMesh
    dims: ParallelDims
    rank: int
    world_size: int

    @classmethod
    def from_mesh(cls, mesh: ParallelMesh) -> DemoContext:
        """The context of a mesh built elsewhere (a notebook, a test)."""
        import torch.distributed as dist

        return cls(mesh=mesh, dims=mesh.dims, rank=dist.get_rank(), world_size=dist.get_world_size())


class CheckResult:
    """What a check measured on this rank: named fields (which a test compares with its own single-process
    reference) and :attr:`summary`, the line the demo prints."""

    @property
    def summary(self) -> str:
        """The line the demo prints for this result (each result class says it)."""
        raise NotImplementedError


Check = Callable[[DemoContext], CheckResult]


# ---- the mesh and its groups ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TopologyResult(CheckResult):
    """What :func:`check_topology` measured on this rank."""

    order: str
    coords: dict[str, int]
    """This rank's coordinates, as the mesh says."""
    groups: dict[str, list[int]]
    """This rank's group on every axis of the mesh (sub-axes and derived axes too), as the mesh built it."""

    @property
    def summary(self) -> str:
        """The line the demo prints for this result."""
        return f"topology: coords and groups of {len(self.groups)} axes match ParallelDims (order {self.order})"


def check_topology(ctx: DemoContext) -> TopologyResult:
    """The mesh's coordinates and groups equal the pure plan (:meth:`ParallelDims.group_of`) on every axis
    (the cp sub-axes too when cp is split).

    Returns:
        This rank's coordinates and groups, as the mesh says.

    Raises:
        CheckFailed: the coordinates or a group differ from the plan.
    """
    result = TopologyResult(
        ctx.dims.shown_order, ctx.mesh.coords(), {axis: ctx.mesh.ranks(axis) for axis in mesh_axes(ctx.dims)}
    )
    if result.coords != ctx.dims.coords(ctx.rank):
        raise CheckFailed(f"coords {result.coords} != plan {ctx.dims.coords(ctx.rank)}")
    bad = [
        f"{axis}: mesh {ranks} != plan {ctx.dims.group_of(axis, ctx.rank)}"
        for axis, ranks in result.groups.items()
        if ranks != ctx.dims.group_of(axis, ctx.rank)
    ]
    if bad:
        raise CheckFailed("; ".join(bad))
    return result


@dataclasses.dataclass(frozen=True)
class AllReduceResult(CheckResult):
    """What :func:`check_all_reduce` measured on this rank."""

    sums: dict[str, int]
    """Per axis: the all-reduced (SUM) global rank over this rank's group."""

    @property
    def summary(self) -> str:
        """The line the demo prints for this result."""
        return f"all-reduce: SUM of the global rank over each group of {len(self.sums)} axes = the sum of its ranks"


def check_all_reduce(ctx: DemoContext) -> AllReduceResult:
    """All-reduce (SUM) of the global rank over each axis's group equals the sum of that group's ranks.

    Returns:
        The all-reduced sum on every axis.

    Raises:
        CheckFailed: a sum differs from the sum of the group's ranks.
    """
    import torch
    import torch.distributed as dist

    sums = {}
    for axis in mesh_axes(ctx.dims):
        total = torch.tensor([ctx.rank], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.mesh.group(axis))
        sums[axis] = int(total.item())
    bad = [
        f"{axis}: all-reduce gave {total}, sum of {ctx.mesh.ranks(axis)} is {sum(ctx.mesh.ranks(axis))}"
        for axis, total in sums.items()
        if total != sum(ctx.mesh.ranks(axis))
    ]
    if bad:
        raise CheckFailed("; ".join(bad))
    return AllReduceResult(sums)


def _max_err(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    if a.shape != b.shape:
        raise CheckFailed(f"{what}: shape {tuple(a.shape)} != single-process {tuple(b.shape)}")
    return (a.float() - b.float()).abs().max().item()


# ---- context parallel on a video latent -----------------------------------------------------------------
VIDEO_SEED = 7
"""Seed of the latent and position embeddings of :func:`check_cp_video_split` (a generator of its own)."""


def video_inputs(cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of :func:`check_cp_video_split` at ``cp``: the same on every rank and in a single-process
    reference.

    Returns:
        ``(latent (B, C, T, H, W), positions (T, H, W, C))``.
    """
    import torch

    shape = (2, 4, 4, 4 * cp, 6)  # T=4 takes gcd(4, cp) of cp; H (patch 2) always takes the rest
    g = torch.Generator().manual_seed(VIDEO_SEED)
    latent = torch.randn(shape, generator=g)
    return latent, torch.randn(*shape[2:], shape[1], generator=g)


@dataclasses.dataclass(frozen=True)
class VideoSplitResult(CheckResult):
    """What :func:`check_cp_video_split` measured on this rank."""

    shape: tuple[int, ...]
    cp: int
    cp_t: int
    cp_h: int
    local_thw: tuple[int, int, int]
    local_tokens: int
    """Tokens of this rank's shard (per sample)."""
    restored: torch.Tensor
    """``gather(shard(latent))``: must be the latent, bit for bit."""
    output: torch.Tensor
    """``gather(tanh(shard) + shard_positions(pos))`` as a ``(B, C, T, H, W)`` video."""
    max_err: float
    """Largest deviation of ``output`` from the single-process ``tanh(latent) + pos``."""

    @property
    def summary(self) -> str:
        """The line the demo prints for this result."""
        return (
            f"cp video split: {self.shape} latent over cp={self.cp} = {self.cp_t} (T) x {self.cp_h} (H) blocks of "
            f"{self.local_thw}; gather(tanh(x) + pos) = one process (err {self.max_err:.0e})"
        )


def check_cp_video_split(ctx: DemoContext, *, tol: float = 1e-6) -> VideoSplitResult:
    """Split a (B, C, T, H, W) latent over cp (time, then height), apply ``tanh(x) + pos`` per token with the
    matching position embeddings, gather: equals the whole latent done in one process.

    Returns:
        The shard's layout, the gathered latent and output, and the output's error.

    Raises:
        CheckFailed: the shard's size, the gathered latent or the gathered output is wrong (beyond ``tol``).
    """
    import torch
    from einops import rearrange

    import wf_mesh

    cp = ctx.mesh.size("cp")
    latent, pos = video_inputs(cp)
    split = wf_mesh.plan_video_split(latent.shape, cp_size=cp)
    tokens = split.shard(latent, mesh=ctx.mesh)  # (B, T'*H'*W, C): this rank's block, no collective
    out = torch.tanh(tokens) + split.shard_positions(pos, mesh=ctx.mesh)
    restored = split.gather(split.shard(latent, mesh=ctx.mesh), mesh=ctx.mesh)  # one all-gather each
    video = split.gather(out, mesh=ctx.mesh)

    full = rearrange(torch.tanh(rearrange(latent, "b c t h w -> b t h w c")) + pos, "b t h w c -> b c t h w")
    if tokens.shape[1] * cp != latent[0, 0].numel():
        raise CheckFailed(f"shard holds {tokens.shape[1]} tokens, expected {latent[0, 0].numel()} / cp={cp}")
    if not torch.equal(restored, latent):
        raise CheckFailed(f"gather(shard(latent)) differs from the latent by {_max_err(restored, latent, 'gather')}")
    err = _max_err(video, full, "gathered output")
    if err > tol:
        raise CheckFailed(f"gathered tanh(x) + pos differs from the single-process result by {err:.2e} > {tol}")
    return VideoSplitResult(
        tuple(latent.shape), cp, split.cp_t, split.cp_h, split.local_thw, tokens.shape[1], restored, video, err
    )


# ---- FSDP2 + EMA ----------------------------------------------------------------------------------------
def tiny_mlp() -> torch.nn.Sequential:
    """The MLP of :func:`check_fsdp_ema`: the same initial weights on every rank (the caller's RNG untouched)."""
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=()):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def fsdp_batch(step: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs (ranks, 4, 8), targets (ranks, 4, 4))`` of ``step``: one slice per dp_cp rank."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ranks, 4, 8, generator=g), torch.randn(ranks, 4, 4, generator=g)


@dataclasses.dataclass(frozen=True)
class FsdpEmaResult(CheckResult):
    """What :func:`check_fsdp_ema` measured on this rank."""

    steps: int
    beta: float
    fsdp_size: int
    """Ranks of the dp_cp axis the MLP is sharded over."""
    weights: dict[str, torch.Tensor]
    """The model's full weights after the last step (``full_tensor`` of each shard)."""
    ema: dict[str, torch.Tensor]
    """The EMA's full weights (``full_tensor`` of its state_dict)."""
    max_err: float
    """Largest deviation of weights and EMA from the single-process run."""

    @property
    def summary(self) -> str:
        """The line the demo prints for this result."""
        numel = sum(t.numel() for t in self.weights.values())
        return (
            f"fsdp2 + ema: {self.steps} AdamW steps, {numel}-param MLP sharded over {FSDP_AXIS} "
            f"({plural(self.fsdp_size, 'rank')}); EMA full weights = one process (err {self.max_err:.0e})"
        )


def _full(parameter: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 parameter (a DTensor)."""
    dtensor: Any = parameter
    return dtensor.full_tensor().detach()


def check_fsdp_ema(ctx: DemoContext, *, steps: int = 3, beta: float = 0.9, tol: float = 1e-5) -> FsdpEmaResult:
    """``fully_shard`` a tiny MLP over the FSDP axis (dp_cfg_cp: dp_cp while cfg is 1), train a few AdamW steps on per-rank batches with a
    :class:`~wf_mesh.ShardedEMA` update after each; the EMA's full weights (DTensor ``full_tensor``) and the
    model's equal a single-process run on the whole batch with a plain float32 EMA.

    Returns:
        The full weights and EMA after the last step, and their error.

    Raises:
        CheckFailed: a shape differs, or the weights or the EMA differ from the single-process run beyond ``tol``.
    """
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import wf_mesh

    fsdp, index, size = ctx.mesh.fsdp_mesh(), ctx.mesh.rank(FSDP_AXIS), ctx.mesh.size(FSDP_AXIS)
    ref = tiny_mlp()
    model = tiny_mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    ema = wf_mesh.ShardedEMA(model, beta=beta)
    ref_ema = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        xs, ys = fsdp_batch(step, size)
        nn.functional.mse_loss(model(xs[index]), ys[index]).backward()  # FSDP2 averages gradients over the FSDP axis
        opt.step()
        opt.zero_grad()
        ema.update(model)
        nn.functional.mse_loss(ref(xs.flatten(0, 1)), ys.flatten(0, 1)).backward()  # the whole batch at once
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                ref_ema[n].mul_(beta).add_(p, alpha=1 - beta)
    full_ema = {n: v.full_tensor() for n, v in ema.state_dict().items()}  # all-gathers over dp_cp
    full_model = {n: _full(p) for n, p in model.named_parameters()}
    ema_err = max(_max_err(full_ema[n], ref_ema[n], f"EMA {n}") for n in ref_ema)
    model_err = max(_max_err(full_model[n], p, f"weight {n}") for n, p in ref.named_parameters())
    if ema_err > tol or model_err > tol:
        raise CheckFailed(
            f"FSDP2 run differs from one process: EMA by {ema_err:.2e}, weights by {model_err:.2e} (tol {tol})"
        )
    return FsdpEmaResult(steps, beta, size, full_model, full_ema, max(ema_err, model_err))


# ---- pipeline ring --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PipelineRingResult(CheckResult):
    """What :func:`check_pipeline_ring` measured on this rank."""

    ring: list[int]
    """Global ranks of this rank's pp group, stage order."""
    stage: int
    received: list[int]
    """``[hops, sum of the global ranks it passed]`` as this stage received it."""
    rings: int

    @property
    def summary(self) -> str:
        """The line the demo prints for this result."""
        path = " -> ".join(map(str, [*self.ring, self.ring[0]]))
        return f"pipeline ring: a token went around {plural(self.rings, 'pp ring')} ({path} here) via PipelineP2P"


def check_pipeline_ring(ctx: DemoContext) -> PipelineRingResult:
    """A token goes once around each pp ring over :class:`~wf_mesh.PipelineP2P` (checked sends and receives);
    every stage adds its global rank, and stage 0 gets ``[pp, sum of the ring's ranks]``. Skipped when pp=1 (a
    single stage has no neighbour).

    Returns:
        This rank's ring, stage and what it received.

    Raises:
        CheckSkipped: pp is 1.
        CheckFailed: a stage received something other than the hops and ranks before it.
    """
    import torch

    import wf_mesh

    pp = ctx.mesh.size("pp")
    if pp == 1:
        raise CheckSkipped("pipeline ring: pp=1, a single stage has no neighbour to send to (try --pp 2)")
    link = wf_mesh.PipelineP2P(ctx.mesh)
    ring, stage = ctx.mesh.ranks("pp"), link.stage
    mine = torch.tensor([1, ctx.rank])  # [hops, sum of global ranks]
    if link.is_first:
        link.send(mine)
        got = link.recv((2,), torch.int64)  # back from the last stage: the ring wraps
        expected = [pp, sum(ring)]
    else:
        got = link.recv((2,), torch.int64)
        link.send(got + mine)
        expected = [stage, sum(ring[:stage])]
    link.wait_sends()
    if got.tolist() != expected:
        raise CheckFailed(
            f"pp stage {stage} of ring {ring} received [hops, rank sum] {got.tolist()}, expected {expected}"
        )
    return PipelineRingResult(ring, stage, got.tolist(), ctx.world_size // pp)


CHECKS: list[Check] = [check_topology, check_all_reduce, check_cp_video_split, check_fsdp_ema, check_pipeline_ring]
"""The demo's checks, in order."""


def _title(check: Check) -> str:
    return check.__name__.removeprefix("check_").replace("_", " ")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One check's outcome, agreed by every rank (except :attr:`result`, this rank's own)."""

    check: str
    """The check function's name."""
    status: str
    """``"ok"``, ``"skip"`` or ``"fail"``."""
    message: str
    """Rank 0's summary (ok), why the check was skipped, or each failing rank's message."""
    seconds: float
    """The slowest rank's time."""
    failed_ranks: tuple[int, ...] = ()
    result: CheckResult | None = None
    """What the check measured on this rank (ok only)."""

    @property
    def line(self) -> str:
        """The console line: ``ok   <summary> (0.12 s)``, ``skip <why> (..)``, ``FAIL <check> on ranks [..] ...``."""
        if self.status == "fail":
            return f"FAIL {self.check} on ranks {list(self.failed_ranks)} ({self.seconds:.2f} s): {self.message}"
        return f"{self.status:<4} {self.message} ({self.seconds:.2f} s)"


def run_checks(
    ctx: DemoContext, checks: Sequence[Check] = CHECKS, *, echo: Callable[[str], None] | None = None
) -> list[Outcome]:
    """Run ``checks`` collectively; one :class:`Outcome` per check run (stopping after the first that fails on
    any rank), agreed on every rank.

    ``echo`` (e.g. ``print`` on rank 0) gets a ``[i/n] title ...`` line before each check and its outcome's
    line after.

    Returns:
        The outcomes, in order; an exception a check raises becomes a failed outcome, it is not raised.
    """
    import torch.distributed as dist

    outcomes = []
    for i, check in enumerate(checks, 1):
        if echo is not None:
            echo(f"[{i}/{len(checks)}] {_title(check)} ...")
        start = time.perf_counter()
        result = None
        try:
            result = check(ctx)
            status, message = "ok", result.summary
        except CheckSkipped as e:
            status, message = "skip", e.args[0]
        except Exception as e:
            status, message = "fail", e.args[0] if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
        reports: list[tuple[str, str, float]] = [None] * ctx.world_size  # type: ignore[list-item]
        dist.all_gather_object(reports, (status, message, time.perf_counter() - start))
        seconds = max(t for _, _, t in reports)
        failed = [(rank, message) for rank, (status, message, _) in enumerate(reports) if status == "fail"]
        if failed:
            details = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
            outcome = Outcome(check.__name__, "fail", details, seconds, tuple(r for r, _ in failed))
        else:
            outcome = Outcome(check.__name__, reports[0][0], reports[0][1], seconds, result=result)
        outcomes.append(outcome)
        if echo is not None:
            echo(outcome.line)
        if failed:
            break
    return outcomes


def format_summary(world_size: int, outcomes: Sequence[Outcome], seconds: float, alive: float) -> str:
    """The demo's last line on success: how many of the checks passed and which were skipped, the time from
    joining the world to the last check, and how long the worker has been alive (its torch import too;
    ``wf-mesh demo`` adds the launcher's own time when it exits).

    Args:
        world_size: the number of ranks.
        outcomes: what :func:`run_checks` returned.
        seconds: the time from joining the world (building the mesh) to the last check.
        alive: the time since this worker started.

    Returns:
        ``demo OK: 4 ranks, 4 of 5 checks passed, 1 skipped (pipeline ring); ...``.
    """
    passed = sum(o.status == "ok" for o in outcomes)
    skipped = [o.check.removeprefix("check_").replace("_", " ") for o in outcomes if o.status == "skip"]
    skips = f", {len(skipped)} skipped ({', '.join(skipped)})" if skipped else ""
    return (
        f"demo OK: {plural(world_size, 'rank')}, {passed} of {len(outcomes)} checks passed{skips}; {seconds:.2f} s "
        f"from joining to the last check, {alive:.2f} s since this worker started (torch import included)"
    )


def _rank_report(ctx: DemoContext) -> dict:
    axes = mesh_axes(ctx.dims)
    coords = {**ctx.mesh.coords(), **(ctx.dims.sub_coords(ctx.rank) if ctx.dims.cp_ulysses > 1 else {})}
    return {"rank": ctx.rank, "coords": coords, "groups": {a: ctx.mesh.ranks(a) for a in axes}}


def format_report(reports: Sequence[dict]) -> str:
    """Per-rank table: rank, its coordinates, and its group on every axis of the mesh (as the mesh built it)."""
    coords = list(reports[0]["coords"])
    axes = list(reports[0]["groups"])
    rows = [
        [r["rank"], *(r["coords"][a] for a in coords), "|", *(format_ranks(r["groups"][a]) for a in axes)]
        for r in reports
    ]
    header = ["rank", *coords, "|", *axes]
    table = format_table(header, rows, align="r" * (len(coords) + 1))
    return f"each rank's coordinates and its group on every axis (as the mesh built them):\n{table}"


def _start(dims: ParallelDims) -> DistributedSession:
    """The demo's session: CPU processes on gloo (also on a machine with GPUs), whatever launched them."""
    import datetime

    import wf_mesh

    timeout = datetime.timedelta(minutes=TIMEOUT_MINUTES)
    return wf_mesh.init_from_env(dims, backend="gloo", device_type="cpu", timeout=timeout)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m wf_mesh.demo", description=(__doc__ or "").splitlines()[0])
    add_degree_flags(parser)
    return parser.parse_args(argv)


def _say(line: str) -> None:
    print(line, flush=True)


def _progress(stage: str) -> None:
    """Tell ``wf-mesh demo`` (which watches the folder named by WF_MESH_DEMO_PROGRESS) how far this worker got."""
    folder = os.environ.get("WF_MESH_DEMO_PROGRESS")
    if not folder:
        return
    path = os.path.join(folder, os.environ.get("LOCAL_RANK", "0"))
    try:
        with open(path + ".tmp", "w") as f:
            f.write(stage)
        os.replace(path + ".tmp", path)
    except OSError:  # the launcher is gone: nothing to tell
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo on this rank (under torchrun); returns the exit code (0 ok, 1 a check failed, 2 bad input)."""
    _progress("started")
    args = _parse(argv)
    if "WORLD_SIZE" not in os.environ:
        print("wf_mesh.demo: error: WORLD_SIZE is not set; run it with `wf-mesh demo` or torchrun", file=sys.stderr)
        return 2
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    try:
        dims = dims_from_args(args).resolve(world_size)
    except (TypeError, ValueError) as e:
        if rank == 0:
            print(f"wf_mesh.demo: error: {e}", file=sys.stderr)
        return 2

    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401 - imported here, so the checks' times are not import times

    import wf_mesh

    for name in ("plan_video_split", "ShardedEMA", "PipelineP2P", "init_from_env"):  # wf_mesh's lazy imports
        getattr(wf_mesh, name)
    _progress("imported")
    start = time.perf_counter()
    with _start(dims) as session:
        _progress("joined")
        mesh = session.mesh
        ctx = DemoContext.from_mesh(mesh)
        reports: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(_rank_report(ctx), reports, dst=0)
        if rank == 0:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            procs = f"{per_node} process{'es' if per_node > 1 else ''}"
            nodes = f" ({world_size // per_node} nodes x {procs})" if per_node < world_size else ""
            _say(f"wf-mesh demo: {world_size} ranks{nodes} on {mesh.backend}/{mesh.device_type}, {dims}")
            _say(format_report(reports or []))
        outcomes = run_checks(ctx, echo=_say if rank == 0 else None)
        elapsed = time.perf_counter() - start
        ok = all(o.status != "fail" for o in outcomes)
        if rank == 0:
            if ok:
                _say(format_summary(world_size, outcomes, elapsed, time.monotonic() - _STARTED))
            else:
                print(f"demo FAILED: {world_size} ranks, {dims}: {outcomes[-1].line}", file=sys.stderr, flush=True)
    _progress("done")
    return 0 if ok else 1


def launch(argv: Sequence[str]) -> int:
    """Run torch's launcher (``torch.distributed.run``, i.e. torchrun) with ``argv`` in this process. A failed
    worker is reported as one line (ranks and exit codes) instead of torchrun's report: the workers have said
    what failed.

    Returns:
        The launcher's exit code (1 when a worker failed).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(list(argv))
    except ChildFailedError as e:
        failed = sorted(e.failures.items())
        ranks, codes = [rank for rank, _ in failed], [f.exitcode for _, f in failed]
        print(f"wf-mesh demo: {len(failed)} worker(s) failed: ranks {ranks}, exit codes {codes}", file=sys.stderr)
        return 1
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return 0


def _exit(code: int) -> None:
    """Flush and leave at once: the interpreter's teardown of torch takes a second or more on a busy machine
    (per process), and there is nothing left to clean up."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["launch"]:  # `wf-mesh demo` runs `python -m wf_mesh.demo launch <torchrun arguments>`
        _exit(launch(sys.argv[2:]))
    _exit(main())
