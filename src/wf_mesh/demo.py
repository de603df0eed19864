"""The demo ``wf-mesh demo`` runs on every rank: the mesh, CP on a video latent, FSDP2 + EMA, the pipeline ring.

Run it under torch's launcher (``wf-mesh demo --nproc 4 --tp 2 --cp 2`` does this for you, and shows the
workers' progress while they start)::

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m wf_mesh.demo --tp 2 --cp 2

``wf-mesh demo`` runs the launcher as ``python -m wf_mesh.demo launch <torchrun arguments>`` (:func:`launch`:
torchrun in-process, a failed worker reported in one line, and an exit that skips the interpreter's slow
teardown of torch). Each worker records how far it got (:data:`wf_mesh.cli.STAGES`) in the folder named by
``WF_MESH_DEMO_PROGRESS``, which ``wf-mesh demo`` watches.

The demo is a list of checks (:data:`CHECKS`). Each is a module-level function of a :class:`DemoContext` that
every rank calls collectively and that returns a one-line result, raises :class:`CheckSkipped` (nothing to
show at these degrees) or raises :class:`CheckFailed`. Every distributed result is compared with the same
computation done in one process on the rank. After each check the ranks exchange outcomes, so all of them
agree; rank 0 prints progress, one timed line per check, then ``demo OK: ...``. Any failure is printed (on
rank 0, naming the ranks) and every rank exits with code 1. From a notebook, on a running mesh::

    ctx = DemoContext.from_mesh(wf_mesh.get_parallel_mesh())
    ok, lines = run_checks(ctx, echo=print if ctx.rank == 0 else None)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from wf_mesh.topology import ParallelDims
from wf_mesh.viz import format_ranks, format_table, mesh_axes

if TYPE_CHECKING:
    import torch

    from wf_mesh.mesh import ParallelMesh

# torch is imported when a check runs (or by main, after telling `wf-mesh demo` that this worker started):
# importing it takes seconds, and the launcher shows the workers' progress meanwhile.

__all__ = [
    "CHECKS",
    "CheckFailed",
    "CheckSkipped",
    "DemoContext",
    "check_all_reduce",
    "check_cp_video_split",
    "check_fsdp_ema",
    "check_pipeline_ring",
    "check_topology",
    "format_report",
    "main",
    "run_checks",
]

TIMEOUT_MINUTES = 5
DEFAULT_ORDER = "tp-cp-pp-dp"


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


Check = Callable[[DemoContext], str]


# ---- the mesh and its groups ----------------------------------------------------------------------------
def check_topology(ctx: DemoContext) -> str:
    """The mesh's coordinates and groups equal the pure plan (:meth:`ParallelDims.group_of`) on every axis
    (the cp sub-axes too when cp is split)."""
    if ctx.mesh.coords() != ctx.dims.coords(ctx.rank):
        raise CheckFailed(f"coords {ctx.mesh.coords()} != plan {ctx.dims.coords(ctx.rank)}")
    axes = mesh_axes(ctx.dims)
    bad = [
        f"{axis}: mesh {ctx.mesh.ranks(axis)} != plan {ctx.dims.group_of(axis, ctx.rank)}"
        for axis in axes
        if ctx.mesh.ranks(axis) != ctx.dims.group_of(axis, ctx.rank)
    ]
    if bad:
        raise CheckFailed("; ".join(bad))
    return f"topology: coords and groups of {len(axes)} axes match ParallelDims (order {ctx.dims.order})"


def check_all_reduce(ctx: DemoContext) -> str:
    """All-reduce (SUM) of the global rank over each axis's group equals the sum of that group's ranks."""
    import torch
    import torch.distributed as dist

    bad, axes = [], mesh_axes(ctx.dims)
    for axis in axes:
        total = torch.tensor([ctx.rank], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.mesh.group(axis))
        expected = sum(ctx.mesh.ranks(axis))
        if total.item() != expected:
            bad.append(f"{axis}: all-reduce gave {total.item()}, sum of {ctx.mesh.ranks(axis)} is {expected}")
    if bad:
        raise CheckFailed("; ".join(bad))
    return f"all-reduce: SUM of the global rank over each group of {len(axes)} axes = the sum of its ranks"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _max_err(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    if a.shape != b.shape:
        raise CheckFailed(f"{what}: shape {tuple(a.shape)} != single-process {tuple(b.shape)}")
    return (a.float() - b.float()).abs().max().item()


# ---- context parallel on a video latent -----------------------------------------------------------------
def check_cp_video_split(ctx: DemoContext, *, tol: float = 1e-6) -> str:
    """Split a (B, C, T, H, W) latent over cp (time, then height), apply ``tanh(x) + pos`` per token with the
    matching position embeddings, gather: equals the whole latent done in one process."""
    import torch
    from einops import rearrange

    import wf_mesh

    cp = ctx.mesh.size("cp")
    shape = (2, 4, 4, 4 * cp, 6)  # T=4 takes gcd(4, cp) of cp; H (patch 2) always takes the rest
    g = torch.Generator().manual_seed(7)
    latent = torch.randn(shape, generator=g)  # the same on every rank
    pos = torch.randn(*shape[2:], shape[1], generator=g)  # (T, H, W, C)
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
    return (
        f"cp video split: {shape} latent over cp={cp} = {split.cp_t} (T) x {split.cp_h} (H) blocks of "
        f"{split.local_thw}; gather(tanh(x) + pos) = one process (err {err:.0e})"
    )


# ---- FSDP2 + EMA ----------------------------------------------------------------------------------------
def _tiny_mlp() -> torch.nn.Sequential:
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=()):  # the same initial weights on every rank; caller's RNG untouched
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def check_fsdp_ema(ctx: DemoContext, *, steps: int = 3, beta: float = 0.9, tol: float = 1e-5) -> str:
    """``fully_shard`` a tiny MLP over the FSDP axis (dp_cp), train a few AdamW steps on per-rank batches with a
    :class:`~wf_mesh.ShardedEMA` update after each; the EMA's full weights (DTensor ``full_tensor``) and the
    model's equal a single-process run on the whole batch with a plain float32 EMA."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import wf_mesh

    fsdp, index, size = ctx.mesh.fsdp_mesh(), ctx.mesh.rank("dp_cp"), ctx.mesh.size("dp_cp")
    ref = _tiny_mlp()
    model = _tiny_mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    ema = wf_mesh.ShardedEMA(model, beta=beta)
    ref_ema = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        xs, ys = torch.randn(size, 4, 8, generator=g), torch.randn(size, 4, 4, generator=g)
        nn.functional.mse_loss(model(xs[index]), ys[index]).backward()  # FSDP2 averages gradients over dp_cp
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
    full_model = {n: p.full_tensor() for n, p in model.named_parameters()}
    ema_err = max(_max_err(full_ema[n], ref_ema[n], f"EMA {n}") for n in ref_ema)
    model_err = max(_max_err(full_model[n], p, f"weight {n}") for n, p in ref.named_parameters())
    if ema_err > tol or model_err > tol:
        raise CheckFailed(
            f"FSDP2 run differs from one process: EMA by {ema_err:.2e}, weights by {model_err:.2e} (tol {tol})"
        )
    numel = sum(p.numel() for p in ref.parameters())
    return (
        f"fsdp2 + ema: {steps} AdamW steps, {numel}-param MLP sharded over dp_cp ({_plural(size, 'rank')}); "
        f"EMA full weights = one process (err {ema_err:.0e})"
    )


# ---- pipeline ring --------------------------------------------------------------------------------------
def check_pipeline_ring(ctx: DemoContext) -> str:
    """A token goes once around each pp ring with the legacy ``PPScheduler`` (``isend_next`` +
    ``recv_prev_data``); every stage adds its global rank, and stage 0 gets ``[pp, sum of the ring's ranks]``.
    Skipped when pp=1 (a single stage has no neighbour)."""
    import torch

    import wf_mesh

    pp = ctx.mesh.size("pp")
    if pp == 1:
        raise CheckSkipped("pipeline ring: pp=1, a single stage has no neighbour to send to (try --pp 2)")
    sched = wf_mesh.pp_scheduler_or_none()
    if sched is None or sched.mesh is not ctx.mesh:
        sched = wf_mesh.PPScheduler(ctx.mesh)
    ring, stage = ctx.mesh.ranks("pp"), sched.stage
    mine = torch.tensor([1, ctx.rank])  # [hops, sum of global ranks]
    if stage == 0:
        sched.isend_next(mine)
        got = sched.recv_prev_data((2,), torch.int64)  # back from the last stage: the ring wraps
        expected = [pp, sum(ring)]
    else:
        got = sched.recv_prev_data((2,), torch.int64)
        sched.isend_next(got + mine)
        expected = [stage, sum(ring[:stage])]
    sched.wait_sends()
    if got.tolist() != expected:
        raise CheckFailed(
            f"pp stage {stage} of ring {ring} received [hops, rank sum] {got.tolist()}, expected {expected}"
        )
    path = " -> ".join(map(str, [*ring, ring[0]]))
    rings = _plural(ctx.world_size // pp, "pp ring")
    return f"pipeline ring: a token went around {rings} ({path} here) via isend_next / recv_prev_data"


CHECKS: list[Check] = [check_topology, check_all_reduce, check_cp_video_split, check_fsdp_ema, check_pipeline_ring]
"""The demo's checks, in order."""


def _title(check: Check) -> str:
    return check.__name__.removeprefix("check_").replace("_", " ")


def run_checks(
    ctx: DemoContext, checks: Sequence[Check] = CHECKS, *, echo: Callable[[str], None] | None = None
) -> tuple[bool, list[str]]:
    """Run ``checks`` collectively; return ``(all passed, one line per check run)``, the same on every rank.

    Each line starts with ``ok``, ``skip`` or ``FAIL`` and ends with the check's time (the slowest rank's).
    Stops at the first check that fails on any rank (its line names the failing ranks and their messages).
    ``echo`` (e.g. ``print`` on rank 0) gets a ``[i/n] title ...`` line before each check and its line after.
    """
    import torch.distributed as dist

    lines = []
    for i, check in enumerate(checks, 1):
        if echo is not None:
            echo(f"[{i}/{len(checks)}] {_title(check)} ...")
        start = time.perf_counter()
        try:
            status, message = "ok", check(ctx)
        except CheckSkipped as e:
            status, message = "skip", e.args[0]
        except Exception as e:
            status, message = "fail", e.args[0] if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
        outcomes: list[tuple[str, str, float]] = [None] * ctx.world_size  # type: ignore[list-item]
        dist.all_gather_object(outcomes, (status, message, time.perf_counter() - start))
        seconds = max(t for _, _, t in outcomes)
        failed = [(rank, message) for rank, (status, message, _) in enumerate(outcomes) if status == "fail"]
        if failed:
            details = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
            lines.append(f"FAIL {check.__name__} on ranks {[r for r, _ in failed]} ({seconds:.2f} s): {details}")
        else:
            status, message, _ = outcomes[0]
            lines.append(f"{status:<4} {message} ({seconds:.2f} s)")
        if echo is not None:
            echo(lines[-1])
        if failed:
            return False, lines
    return True, lines


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


def _init(dims: ParallelDims) -> ParallelMesh:
    import datetime

    import torch.distributed as dist

    import wf_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=TIMEOUT_MINUTES))
    return wf_mesh.init_parallel(dims)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m wf_mesh.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp-ulysses", type=int, default=1)
    parser.add_argument("--order", default=DEFAULT_ORDER)
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
        dims = ParallelDims(tp=args.tp, cp=args.cp, pp=args.pp, order=args.order, cp_ulysses=args.cp_ulysses).resolve(
            world_size
        )
    except (TypeError, ValueError) as e:
        if rank == 0:
            print(f"wf_mesh.demo: error: {e}", file=sys.stderr)
        return 2

    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401 - imported here, so the checks' times are not import times

    import wf_mesh

    for name in ("plan_video_split", "ShardedEMA", "PPScheduler"):  # wf_mesh's lazy imports, done up front
        getattr(wf_mesh, name)
    _progress("imported")
    start = time.perf_counter()
    mesh = _init(dims)
    _progress("joined")
    try:
        ctx = DemoContext.from_mesh(mesh)
        reports = [None] * world_size if rank == 0 else None
        dist.gather_object(_rank_report(ctx), reports, dst=0)
        if rank == 0:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            procs = f"{per_node} process{'es' if per_node > 1 else ''}"
            nodes = f" ({world_size // per_node} nodes x {procs})" if per_node < world_size else ""
            _say(f"wf-mesh demo: {world_size} ranks{nodes} on {mesh.backend}/{mesh.device_type}, {dims}")
            _say(format_report(reports))
        ok, lines = run_checks(ctx, echo=_say if rank == 0 else None)
        elapsed = time.perf_counter() - start
        if rank == 0:
            passed, skipped = (sum(line.startswith(s) for line in lines) for s in ("ok", "skip"))
            if ok:
                _say(f"demo OK: {world_size} ranks, {passed} checks passed, {skipped} skipped, in {elapsed:.2f} s")
            else:
                print(f"demo FAILED: {world_size} ranks, {dims}: {lines[-1]}", file=sys.stderr, flush=True)
    finally:
        wf_mesh.destroy_model_parallel()
        dist.destroy_process_group()
    _progress("done")
    return 0 if ok else 1


def launch(argv: Sequence[str]) -> int:
    """Run torch's launcher (``torch.distributed.run``, i.e. torchrun) with ``argv`` in this process; its exit
    code. A failed worker is reported as one line (ranks and exit codes) instead of torchrun's report: the
    workers have said what failed."""
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
