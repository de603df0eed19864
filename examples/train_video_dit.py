"""Train a tiny video DiT with context parallelism, FSDP2, a sharded EMA and resumable DCP checkpoints.

The model denoises random video latents ``(B, C, T, H, W)``: every latent voxel is a token (per-token input
projection), learned position embeddings ``(T, H, W, D)``, a noise-level embedding, ``--depth`` blocks of
(LayerNorm, attention around :func:`wf_mesh.cp_attention`, LayerNorm, MLP), and an output projection trained
with a flow-matching MSE loss (predict ``noise - latent`` from ``(1 - s) * latent + s * noise``).

Parallelism: the world is ``dp x cp x tp`` (``--cp``, ``--tp``; dp is inferred). Each step draws its data,
noise and noise levels through :meth:`wf_mesh.ParallelMesh.generator` (seeded by ``--seed`` and the step), so
cp and tp peers always see the same numbers: with ``--data-rng global`` (the default) every rank draws the SAME
global batch and each dp rank takes its slice (``torch.tensor_split``: uneven slices allowed), so the run is the
same at every world size; with ``--data-rng dp`` each dp rank draws only its own samples from a stream of its
own (``vary_over=("dp",)``, what large runs do), so the run is the same at every cp and tp for a given dp. Each
cp rank takes its block of tokens (:func:`wf_mesh.plan_video_split`: time, then height, then width); attention
runs over all cp ranks' tokens (``--cp-method ring | ulysses | usp | allgather``), with one
:func:`wf_mesh.plan_cp_attention` per step (``VideoSplit.attention_plan``) for all the blocks: the attention
layers issue their data collectives only. With ``--tp N`` torch's ``parallelize_module`` on ``mesh["tp"]``
splits every block (``ColwiseParallel`` q, k, v and MLP input, ``RowwiseParallel`` out projection and MLP
output: ``TP_PLAN``), so each tp rank runs cp attention on its ``heads / N`` heads. The weights (the tp shards
under tp) are sharded with FSDP2 over the ``dp_cp`` axis (cp ranks hold the same weights, so their gradients
are summed together with dp's).

Exactness: whatever the world size, the gradient every step applies is the gradient of the GLOBAL mean
loss. Each rank backpropagates ``sum of its squared errors / number of elements in the global batch`` and
FSDP2 is told to SUM gradients over dp_cp instead of averaging them (``set_gradient_divide_factor(1.0)``
with sum-only collectives), so the reduced gradient is exactly sum over ranks = d(global mean)/dw, also when
ranks hold different numbers of tokens. The logged loss is the global mean (one all-reduce of the squared
error sums); the logged gradient norm is the global one (``clip_grad_norm_`` over the sharded gradients),
clipped to ``--clip-grad``. Loss trajectory, gradient norms and final weights agree with a single-process run
up to fp32 rounding.

The autoregressive case (``--chunk-frames N``, ``--pack``): attention follows a :class:`wf_mesh.RangeMask` over
the frames-first token order ``(t h w)`` of a sample. ``--chunk-frames N`` makes it block-causal over chunks of
``N`` latent frames (the last chunk takes what is left: :func:`wf_mesh.masks.frame_chunk_sizes`): a token of
chunk c sees every token of chunks <= c. ``--pack`` packs clips of different lengths into each sample's
sequence: the sample's ``T`` frames are cut into clips of 1, 2, 3, ... frames (the last clip takes what is
left: T=8 gives 1, 2, 3, 2), or of the frame counts ``--pack 3,5`` names; a token sees only its own clip
(``RangeMask.packed``), block-causal over chunks of ``N`` frames counted from the clip's first frame when
``--chunk-frames N`` is given too, and each clip's frames take the time position embeddings ``0, 1, ...`` of
a clip of their own. With a mask the cp ranks do NOT take plan_video_split's blocks: one
:func:`wf_mesh.plan_cp_attention` ``(mask=..., mesh=...)`` before the first step (the mask is the same every
step: agreed once, not per step or layer) places whole chunks on the ranks so that each computes about the
same number of unmasked (query, key) pairs (logged: ``plan.imbalance``, max / mean), and every rank takes its
tokens, targets and position embeddings with ``plan.shard`` (no collective). The loss is a sum over tokens
and every token lives on exactly one rank, so the exactness argument above holds unchanged: nothing is
gathered back (``plan.gather`` would restore the global order; training does not need it).

Checkpoints (``--ckpt-dir DIR --save-every N``): model and optimizer (``get_state_dict``, resharded by DCP
at any world size), the EMA (``ShardedEMA.state_dict()`` DTensors) and the step count, saved with
``torch.distributed.checkpoint`` to ``DIR/step_000N``. At start the newest complete checkpoint in
``DIR`` (one with DCP's ``.metadata``, written last and atomically) is loaded and training continues after it;
a checkpoint at (or past) ``--steps`` is a finished run: it says so and trains nothing.

Run::

    python examples/train_video_dit.py                                  # one process, no launcher
    torchrun --nproc-per-node 4 examples/train_video_dit.py --cp 2      # dp 2 x cp 2, ring attention
    srun --ntasks-per-node 4 python examples/train_video_dit.py --cp 2  # SLURM: one task per process
    torchrun --nproc-per-node 4 examples/train_video_dit.py --cp 4 --cp-method usp --cp-ulysses 2
    torchrun --nproc-per-node 4 examples/train_video_dit.py --tp 2 --cp 2  # tp 2 x cp 2: the same run as one process
    torchrun --nproc-per-node 4 examples/train_video_dit.py --cp 2 --data-rng dp  # = --data-rng dp at 2 processes
    torchrun --nproc-per-node 4 examples/train_video_dit.py --cp 4 --frames 8 --chunk-frames 2  # block-causal chunks
    torchrun --nproc-per-node 4 examples/train_video_dit.py --cp 2 --frames 8 --pack --chunk-frames 2  # packed clips
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 examples/train_video_dit.py --ckpt-dir ckpt --save-every 2

The last one resumes from ``ckpt/`` when torchrun restarts a failed worker. (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
by default torchrun keeps one TCPStore across restarts, and a restarted worker may read the gloo/NCCL address
its dead predecessor left there and fail to connect: pytorch/pytorch#135712, #167288.)

From Python (e.g. in the workers of ``wf_mesh.testing.run_distributed``) call ``main(argv)``: it returns a
dict with the per-step global losses and the final weights (see :func:`main`).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from loguru import logger
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import wf_mesh
from wf_mesh.masks import frame_chunk_sizes

CHECKPOINT = re.compile(r"step_(\d+)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=10, help="total optimizer steps (a resumed run stops here too)")
    p.add_argument("--batch", type=int, default=4, help="global batch size (split over dp; uneven splits allowed)")
    p.add_argument("--channels", type=int, default=4, help="latent channels C")
    p.add_argument("--frames", type=int, default=4, help="latent frames T")
    p.add_argument("--height", type=int, default=8, help="latent height H")
    p.add_argument("--width", type=int, default=4, help="latent width W")
    p.add_argument("--dim", type=int, default=32, help="model width D")
    p.add_argument("--heads", type=int, default=2, help="attention heads")
    p.add_argument("--depth", type=int, default=2, help="transformer blocks")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm (0: never)")
    p.add_argument("--ema-beta", type=float, default=0.99, help="EMA decay per step")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and every step's batch")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (dp = world size / (cp * tp))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: q/k/v and MLP weights split over tp")
    p.add_argument("--cp-method", choices=("ring", "ulysses", "usp", "allgather"), default="ring",
                   help="cp attention method")  # fmt: skip
    p.add_argument("--cp-ulysses", type=int, default=1,
                   help="Ulysses part of cp: > 1 and dividing --cp for --cp-method usp, 1 otherwise")  # fmt: skip
    p.add_argument("--data-rng", choices=("global", "dp"), default="global",
                   help="global: every rank draws the whole batch and keeps its rows (the same run at every world "
                        "size); dp: each dp rank draws only its own samples (mesh.generator(vary_over=('dp',)): the "
                        "same run at every cp and tp for a given dp)")  # fmt: skip
    p.add_argument("--chunk-frames", type=int, default=0,
                   help="block-causal attention over chunks of N latent frames (chunk c sees chunks <= c; the last "
                        "chunk takes what is left); 0: full attention")  # fmt: skip
    p.add_argument("--pack", nargs="?", const="auto", default=None, metavar="FRAMES,...",
                   help="pack clips of different lengths into each sample: its frames cut into clips of 1, 2, 3, ... "
                        "frames (the last takes what is left), or of the given frame counts (summing to --frames); "
                        "attention within each clip (block-causal inside it with --chunk-frames)")  # fmt: skip
    p.add_argument("--ckpt-dir", type=Path, default=None, help="save checkpoints here and resume from the newest")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes the result of main() here (torch.save)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep this many seconds after each step (to watch a run, or to give a fault-injection "
                        "test time to act)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress lines, and no log lines of wf_mesh")
    args = p.parse_args(argv)
    for name in "steps batch channels frames height width dim heads depth cp tp cp_ulysses".split():
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} is not divisible by --heads {args.heads}")
    if args.heads % args.tp:
        p.error(f"--heads {args.heads} is not divisible by --tp {args.tp}: each tp rank attends over whole heads")
    if args.clip_grad < 0:
        p.error("--clip-grad must be >= 0")
    if args.save_every < 0:
        p.error("--save-every must be >= 0")
    if args.save_every and args.ckpt_dir is None:
        p.error("--save-every needs --ckpt-dir")
    if args.cp_ulysses > 1 and args.cp_method != "usp":
        p.error("--cp-ulysses > 1 is for --cp-method usp")
    if args.cp_method == "usp" and args.cp_ulysses == 1:
        p.error("--cp-method usp needs --cp-ulysses N > 1 (the Ulysses part of --cp; the ring is the rest)")
    if args.cp % args.cp_ulysses:
        p.error(f"--cp-ulysses {args.cp_ulysses} must divide --cp {args.cp} (cp = ring x ulysses)")
    if args.chunk_frames < 0:
        p.error("--chunk-frames must be >= 0")
    if args.pack is not None:
        args.pack = clip_frames(p, args.pack, args.frames)
    return args


def clip_frames(p: argparse.ArgumentParser, value: str, frames: int) -> tuple[int, ...]:
    """``--pack``'s clips as frame counts: ``auto`` -> 1, 2, 3, ... (the last takes what is left), else the list."""
    if value == "auto":
        clips, left = [], frames
        while left:
            clips.append(min(len(clips) + 1, left))
            left -= clips[-1]
        return tuple(clips)
    try:
        clips = [int(f) for f in value.split(",")]
    except ValueError:
        p.error(f"--pack {value}: give frame counts like 3,5 (or --pack alone)")
    if min(clips) < 1 or sum(clips) != frames:
        p.error(f"--pack {value}: clip frame counts must be >= 1 and sum to --frames {frames}")
    return tuple(clips)


def describe_mask(args: argparse.Namespace) -> str:
    """The attention pattern in words (the start line)."""
    chunks = f"block-causal chunks of {args.chunk_frames} frames" if args.chunk_frames else ""
    if args.pack is None:
        return chunks or "full attention"
    return f"clips of {list(args.pack)} frames packed" + (f", {chunks} inside each" if chunks else "")


def attention_mask(args: argparse.Namespace) -> wf_mesh.RangeMask | None:
    """The mask of ``--chunk-frames`` / ``--pack`` over one sample's ``(t h w)`` tokens; None: full attention."""
    per_frame = args.height * args.width
    if args.pack is None:
        if not args.chunk_frames:
            return None
        return wf_mesh.RangeMask.block_causal(frame_chunk_sizes(args.frames, args.chunk_frames, per_frame))
    lengths = [f * per_frame for f in args.pack]
    if args.chunk_frames:
        return wf_mesh.RangeMask.packed(lengths, causal="block", chunk_size=args.chunk_frames * per_frame)
    return wf_mesh.RangeMask.packed(lengths)


# ---- the model ------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Self-attention over every cp rank's tokens: q, k, v and out projections around :func:`wf_mesh.cp_attention`.

    Separate q, k, v projections so that tensor parallelism can split them by heads (``ColwiseParallel``: each tp
    rank computes ``heads / tp`` whole heads) and the out projection by its input (``RowwiseParallel``: one
    all-reduce over tp). The heads are counted from the local width, so the same code runs at any tp. No
    biases: a key bias shifts every score of a query by the same amount, so its gradient is zero up to rounding,
    and AdamW would turn that noise into full steps.
    """

    def __init__(self, dim: int, heads: int, method: str, mesh: wf_mesh.ParallelMesh) -> None:
        super().__init__()
        self.head_dim, self.method, self.mesh = dim // heads, method, mesh
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, plan: wf_mesh.CPAttentionPlan) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(-1, (-1, self.head_dim)) for proj in (self.q, self.k, self.v))  # tp-local heads
        out = wf_mesh.cp_attention(q, k, v, layout="bshd", method=self.method, mesh=self.mesh, plan=plan)
        return self.out(out.flatten(-2))


TP_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
           "attn.out": RowwiseParallel(), "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}  # fmt: skip
"""Each block's tensor-parallel plan (torch's ``parallelize_module`` on ``mesh["tp"]``)."""


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, method: str, mesh: wf_mesh.ParallelMesh) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, method, mesh)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, plan: wf_mesh.CPAttentionPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), plan=plan)
        return x + self.mlp(self.norm2(x))


class TinyVideoDiT(nn.Module):
    """Noisy tokens ``(B, S_local, C)`` of this cp rank, their noise levels ``(B,)`` and targets -> the SUM of
    this rank's squared errors (the caller normalizes it; see the module docstring).

    The tokens are ``split``'s block of the latent, or with a mask ``plan``'s tokens of the ``(t h w)``
    sequence (``plan.shard``; ``split`` is then unused)."""

    def __init__(self, args: argparse.Namespace, mesh: wf_mesh.ParallelMesh) -> None:
        super().__init__()
        d = args.dim
        self.embed = nn.Linear(args.channels, d)
        self.pos = nn.Parameter(0.02 * torch.randn(args.frames, args.height, args.width, d))
        self.noise_embed = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(Block(d, args.heads, args.cp_method, mesh) for _ in range(args.depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, args.channels)
        # --pack: each clip's frames take time positions 0, 1, ... of their own
        clips = args.pack or (args.frames,)
        self.frame_positions = [f for n in clips for f in range(n)]

    def forward(
        self, tokens, sigma, target, split: wf_mesh.VideoSplit | None, mesh: wf_mesh.ParallelMesh,
        plan: wf_mesh.CPAttentionPlan | None = None,
    ) -> torch.Tensor:  # fmt: skip
        return (self.predict(tokens, sigma, split, mesh, plan) - target).pow(2).sum()

    def predict(
        self, tokens, sigma, split: wf_mesh.VideoSplit | None, mesh: wf_mesh.ParallelMesh,
        plan: wf_mesh.CPAttentionPlan | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The predictions ``(B, S_local, C)`` for this rank's tokens (``plan``: a mask plan's, see the class)."""
        if plan is None:
            assert split is not None
            pos = split.shard_positions(self.pos, mesh=mesh)  # (S_local, D), this rank's tokens' positions
            plan = split.attention_plan(mesh=mesh)  # every rank's token count, agreed once for all the blocks
        else:
            table = self.pos
            if self.frame_positions != list(range(len(self.pos))):
                table = table[torch.tensor(self.frame_positions, device=table.device)]
            pos = plan.shard(table.flatten(0, 2), 0)
        x = self.embed(tokens) + pos + self.noise_embed(sigma[:, None])[:, None, :]
        for block in self.blocks:
            x = block(x, plan)
        return self.head(self.norm(x))


def build_model(args: argparse.Namespace, mesh: wf_mesh.ParallelMesh) -> nn.Module:
    """The same initial weights on every rank (a fixed seed, the caller's RNG untouched), then FSDP2 over dp_cp
    with gradients SUMMED over the ranks (see the module docstring)."""
    with torch.random.fork_rng(devices=()):
        torch.manual_seed(args.seed)
        model = TinyVideoDiT(args, mesh).to(mesh.device)
    if mesh.size("tp") > 1:  # tp first, on the tp axis of the same mesh; then FSDP2 shards the tp shards over dp_cp
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], TP_PLAN)
    fsdp = mesh.fsdp_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the loss is already divided by the GLOBAL element count
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (no PREMUL_SUM: gloo has none)
    return model


# ---- data -----------------------------------------------------------------------------------------------
def local_batch(
    args: argparse.Namespace, step: int, mesh: wf_mesh.ParallelMesh, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(noisy latents, targets, noise levels)`` of this dp rank's samples ``rows`` of ``step``, drawn through
    ``mesh.generator`` (seeded by the seed and the step): equal on the cp and tp peers, which must see the same
    latents, noise and noise levels. ``--data-rng global``: the whole batch, identical on every rank and at every
    world size, cut to ``rows``; ``dp``: only this dp rank's samples, from a stream of its own."""
    seed = args.seed * 1_000_003 + step
    if args.data_rng == "global":
        g, n, keep = mesh.generator(seed, vary_over=()), args.batch, rows
    else:
        g, n, keep = mesh.generator(seed, vary_over=("dp",)), len(rows), slice(None)
    shape = (n, args.channels, args.frames, args.height, args.width)
    latent, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    sigma = torch.rand(n, generator=g)
    s = sigma.view(-1, 1, 1, 1, 1)
    return ((1 - s) * latent + s * noise)[keep], (noise - latent)[keep], sigma[keep]


# ---- checkpoints ----------------------------------------------------------------------------------------
def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:06d}"


def newest_checkpoint(ckpt_dir: Path | None, device: torch.device) -> int:
    """The step of the newest complete checkpoint in ``ckpt_dir`` (0: none), decided by rank 0 for everyone."""
    step = 0
    if ckpt_dir is not None and dist.get_rank() == 0 and ckpt_dir.is_dir():
        for entry in ckpt_dir.iterdir():
            match = CHECKPOINT.fullmatch(entry.name)
            if match and (entry / ".metadata").is_file():  # DCP writes .metadata last (tmp + rename)
                step = max(step, int(match.group(1)))
    found = torch.tensor([step], dtype=torch.int64, device=device)
    dist.broadcast(found, src=0)
    return int(found.item())


def training_state(model, optimizer, ema, step: int, device: torch.device) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "ema": ema.state_dict(),
            "step": torch.tensor(step, dtype=torch.int64, device=device)}  # fmt: skip


def save_checkpoint(path: Path, model, optimizer, ema, step: int, device: torch.device) -> None:
    dcp.save(training_state(model, optimizer, ema, step, device), checkpoint_id=str(path))


def load_checkpoint(path: Path, model, optimizer, ema, device: torch.device) -> int:
    state = training_state(model, optimizer, ema, -1, device)
    dcp.load(state, checkpoint_id=str(path))  # in place, resharded to this world's shards
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ema.load_state_dict(state["ema"])
    return int(state["step"].item())


# ---- training -------------------------------------------------------------------------------------------
def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for gradients on different meshes (FSDP2's ``dp_cp`` and, under tp, ``(dp_cp, tp)``,
    which DTensor cannot stack together): one total norm per mesh, combined; returns the global norm."""
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [nn.utils.get_total_norm([p.grad for p in params]) for params in by_mesh.values()]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    for params in by_mesh.values():
        nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def full_weights(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full CPU copies of (possibly sharded) tensors: an all-gather per DTensor, on every rank."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone() for n, t in named.items()}


def digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict:
    """Train; returns (on every rank)::

        {"world_size", "dp", "cp", "tp", "start_step" (0 or the step resumed from), "steps",
         "imbalance": the mask plan's work imbalance (max / mean over the cp ranks; None without a mask),
         "losses": {step: global mean loss}, "grad_norms": {step: global gradient norm before clipping},
             for the steps this call ran,
         "weights" / "ema": {parameter name: full fp32 CPU tensor} after the last step,
         "digest": a short sha256 of the final weights}

    Starts through :func:`wf_mesh.init_from_env`: it uses the process group if one is initialized (e.g. a
    ``wf_mesh.testing`` worker), otherwise creates it (torchrun's or SLURM's environment, or a world of one),
    and on leaving the ``with`` block tears down what it created.
    """
    args = parse_args(argv)
    if args.quiet:  # wf_mesh's own log lines too (loguru's switch for a library's records)
        logger.disable("wf_mesh")
    try:
        with wf_mesh.init_from_env(wf_mesh.ParallelDims(tp=args.tp, cp=args.cp, cp_ulysses=args.cp_ulysses)) as session:
            return train(args, session.mesh)
    finally:
        if args.quiet:
            logger.enable("wf_mesh")


def train(args: argparse.Namespace, mesh: wf_mesh.ParallelMesh) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, dp_rank, cp, tp = mesh.size("dp"), mesh.rank("dp"), mesh.size("cp"), mesh.size("tp")
    device = mesh.device
    verbose = rank == 0 and not args.quiet

    def log(message: str) -> None:
        if verbose:
            print(message, flush=True)

    if args.batch < dp:
        raise ValueError(f"--batch {args.batch} is smaller than dp={dp}: every dp rank needs at least one sample")
    latent_shape = (args.batch, args.channels, args.frames, args.height, args.width)
    mask = attention_mask(args)
    # a mask: one balanced plan for the whole run (the same mask every step), agreed once; else the video split
    plan = None if mask is None else wf_mesh.plan_cp_attention(mask=mask, mesh=mesh)
    split = wf_mesh.plan_video_split(latent_shape, cp_size=cp) if plan is None else None
    rows = torch.tensor_split(torch.arange(args.batch), dp)[dp_rank]  # this dp rank's samples
    global_elements = math.prod(latent_shape)
    global_tokens = args.batch * args.frames * args.height * args.width

    model = build_model(args, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ema = wf_mesh.ShardedEMA(model, beta=args.ema_beta)
    if plan is None:
        placed = f"{split.local_tokens} of {split.t * split.h * split.w} tokens per sample on each cp rank"
    else:
        placed = (
            f"{describe_mask(args)}, tokens per sample on the cp ranks {list(plan.lengths)} of {plan.seq_len} "
            f"(work imbalance {plan.imbalance:.3f})"
        )
    log(
        f"train_video_dit: {world} process(es) = dp {dp} x cp {cp}{f' x tp {tp}' if tp > 1 else ''} ({args.cp_method}"
        f"{f', ulysses {args.cp_ulysses}' if args.cp_method == 'usp' else ''}), latents {latent_shape}, "
        f"{placed}, {sum(p.numel() for p in model.parameters())} parameters, {args.steps} steps"
    )

    start = newest_checkpoint(args.ckpt_dir, device)
    if start:
        path = checkpoint_path(args.ckpt_dir, start)
        loaded = load_checkpoint(path, model, optimizer, ema, device)
        if loaded != start:
            raise RuntimeError(f"{path} holds step {loaded}, its name says {start}")
        if start >= args.steps:  # nothing left to train: say so, return the checkpoint's weights
            log(f"run already complete at step {start} ({path}, --steps {args.steps}): nothing to train")
        else:
            log(f"resumed from {path} (step {start})")

    losses: dict[int, float] = {}
    grad_norms: dict[int, float] = {}
    for step in range(start + 1, args.steps + 1):
        began = time.perf_counter()
        noisy, target, sigma = (t.to(device) for t in local_batch(args, step, mesh, rows))
        if plan is None:
            tokens, target = split.shard(noisy, mesh=mesh), split.shard(target, mesh=mesh)  # this cp rank's block
        else:  # the (t h w) sequence's tokens the plan gives this cp rank
            tokens, target = (plan.shard(t.flatten(2).transpose(1, 2), 1) for t in (noisy, target))
        squared = model(tokens, sigma, target, split, mesh, plan)
        (squared / global_elements).backward()  # summed over dp_cp by FSDP2: the global mean's gradient
        grad_norms[step] = clip_grad_norm(model, args.clip_grad or math.inf).item()  # of the GLOBAL gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)
        total = squared.detach().clone()
        dist.all_reduce(total, group=mesh.group("dp_cp"))  # every rank's squared errors, once
        losses[step] = total.item() / global_elements
        elapsed = time.perf_counter() - began
        log(
            f"step {step}/{args.steps}  loss {losses[step]:.6f}  grad norm {grad_norms[step]:.4f}  "
            f"tokens/s {global_tokens / elapsed:,.0f}"
        )
        if args.save_every and step % args.save_every == 0:
            path = checkpoint_path(args.ckpt_dir, step)
            save_checkpoint(path, model, optimizer, ema, step, device)
            log(f"saved checkpoint {path}")
        if args.step_delay:
            time.sleep(args.step_delay)

    weights = full_weights(dict(model.named_parameters()))
    result = {
        "world_size": world, "dp": dp, "cp": cp, "tp": tp, "start_step": start, "steps": args.steps,
        "imbalance": None if plan is None else plan.imbalance,
        "losses": losses, "grad_norms": grad_norms,
        "weights": weights, "ema": full_weights(ema.state_dict()), "digest": digest(weights),
    }  # fmt: skip
    if rank == 0 and args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, args.out)
    if losses:
        log(f"done: step {args.steps}, final loss {losses[args.steps]:.6f}, weights sha256 {result['digest']}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
