"""Generate a latent video chunk by chunk with a KV cache under context parallelism (autoregressive decoding).

The model is ``examples/train_video_dit.py``'s ``TinyVideoDiT`` (imported: the same layers, the same initial
weights for a given ``--seed``), used as a block-causal world model: the video's ``--frames`` latent frames are
generated ``--chunk-frames`` at a time. Each chunk starts from noise and is denoised in ``--denoise-steps``
Euler steps of the flow the model is trained on (``x_s = (1 - s) * latent + s * noise``, the model predicting
``noise - latent``); in every pass the chunk's tokens attend to the cached keys and values of the earlier chunks
(``--window W``: the last W only) and to each other (:class:`wf_mesh.KVCache`, ``append=False``: the cache is
left as it was). A last pass at noise level 0 on the clean chunk appends its keys and values to the cache.

Parallelism: the cp ranks split each chunk's tokens (``step.shard``: the cache stays balanced to one token) and
the cache; per attention layer one all-gather of the chunk's queries and one all-to-all of the partial results
(split-KV decoding). The video is the same at every cp (up to rounding: float64 by default, so the printed
checksum agrees to its last digit at cp 1, 2 and 4).

Run::

    python examples/generate_video_dit.py                                   # one process
    torchrun --nproc-per-node 4 examples/generate_video_dit.py --cp 4       # the same video, cp 4
    torchrun --nproc-per-node 2 examples/generate_video_dit.py --cp 2 --window 1 --chunk-frames 1

From Python call ``main(argv)``: it returns ``{"video", "checksum", "world_size", "cp", "lengths"}`` on every
rank (see :func:`main`).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch
import torch.distributed as dist
import train_video_dit
from loguru import logger

import wf_mesh


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--batch", type=int, default=1, help="videos generated at once")
    p.add_argument("--channels", type=int, default=4, help="latent channels C")
    p.add_argument("--frames", type=int, default=6, help="latent frames T")
    p.add_argument("--height", type=int, default=4, help="latent height H")
    p.add_argument("--width", type=int, default=3, help="latent width W")
    p.add_argument("--dim", type=int, default=32, help="model width D")
    p.add_argument("--heads", type=int, default=2, help="attention heads")
    p.add_argument("--depth", type=int, default=2, help="transformer blocks")
    p.add_argument("--chunk-frames", type=int, default=2, help="frames per chunk (the last takes what is left)")
    p.add_argument("--denoise-steps", type=int, default=3, help="Euler steps per chunk")
    p.add_argument("--window", type=int, default=None, help="attend to the last W chunks only (default: all)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree (dp = world size / cp)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64", help="model and cache dtype")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights (as train_video_dit.py) and the noise")
    p.add_argument("--quiet", action="store_true", help="no output, and no log lines of wf_mesh")
    args = p.parse_args(argv)
    for name in "batch channels frames height width dim heads depth chunk_frames denoise_steps cp".split():
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.window is not None and args.window < 0:
        p.error("--window must be >= 0")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} is not divisible by --heads {args.heads}")
    return args


def build_model(args: argparse.Namespace, mesh: wf_mesh.ParallelMesh) -> torch.nn.Module:
    """train_video_dit's model with its initial weights for ``--seed`` (no FSDP: inference), in ``--dtype``."""
    shape = ["--channels", args.channels, "--frames", args.frames, "--height", args.height, "--width", args.width]
    shape += ["--dim", args.dim, "--heads", args.heads, "--depth", args.depth, "--seed", args.seed]
    model_args = train_video_dit.parse_args([str(a) for a in shape])
    with torch.random.fork_rng(devices=()):
        torch.manual_seed(args.seed)
        model = train_video_dit.TinyVideoDiT(model_args, mesh)
    return model.to(device=mesh.device, dtype=getattr(torch, args.dtype)).eval()


def predict(model, step: wf_mesh.KVCacheStep, tokens, pos, sigma: float) -> torch.Tensor:
    """The model's prediction (``noise - latent``) for this rank's tokens of the chunk at noise level ``sigma``;
    every attention layer attends through the cache."""
    levels = tokens.new_full((tokens.shape[0], 1), sigma)
    x = model.embed(tokens) + pos + model.noise_embed(levels)[:, None, :]
    for layer, block in enumerate(model.blocks):
        attn, h = block.attn, block.norm1(x)
        q, k, v = (proj(h).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2) for proj in (attn.q, attn.k, attn.v))
        x = x + attn.out(step.attend(layer, q, k, v).transpose(1, 2).flatten(-2))
        x = x + block.mlp(block.norm2(x))
    return model.head(model.norm(x))


def generate(args: argparse.Namespace, mesh: wf_mesh.ParallelMesh) -> dict:
    model = build_model(args, mesh)
    dtype, device = getattr(torch, args.dtype), mesh.device
    per_frame = args.height * args.width
    cache = wf_mesh.KVCache(
        mesh=mesh, layers=args.depth, batch=args.batch, heads=args.heads, head_dim=args.dim // args.heads,
        dtype=dtype, device=device, window=args.window,
        capacity=math.ceil(args.frames * per_frame / mesh.size("cp")) + 1,
    )  # fmt: skip
    sigmas = torch.linspace(1, 0, args.denoise_steps + 1, dtype=torch.float64).tolist()
    chunks, lengths = [], []
    for first in range(0, args.frames, args.chunk_frames):
        frames = min(args.chunk_frames, args.frames - first)
        length = frames * per_frame
        g = mesh.generator(args.seed * 1_000_003 + first, vary_over=())  # the same noise on every rank
        noise = torch.randn(args.batch, length, args.channels, generator=g, dtype=torch.float64).to(device, dtype)
        pos = model.pos[first : first + frames].reshape(length, -1)  # (t h w) order, as the tokens
        step = cache.next_chunk(length, append=False)
        x, pos = step.shard(noise, 1), step.shard(pos, 0)  # this rank's tokens (the same slice every pass)
        for i, (s, s_next) in enumerate(itertools.pairwise(sigmas)):
            if i:
                step = cache.next_chunk(length, append=False)
            x = x + (s_next - s) * predict(model, step, x, pos, s)
        step = cache.next_chunk(length)  # the clean chunk's keys and values go into the cache
        predict(model, step, x, pos, 0.0)
        lengths.append(cache.lengths)
        chunk = step.gather(x, 1)  # (B, frames * H * W, C) in (t h w) order
        chunks.append(chunk.transpose(1, 2).reshape(args.batch, args.channels, frames, args.height, args.width))
    video = torch.cat(chunks, 2).cpu()
    return {
        "video": video, "checksum": float(video.double().sum()), "world_size": dist.get_world_size(),
        "cp": mesh.size("cp"), "lengths": lengths,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    """Generate; returns on every rank ``{"video": (B, C, T, H, W) CPU tensor, "checksum": its sum,
    "world_size", "cp", "lengths": each cp rank's cached tokens after each chunk}`` and prints (rank 0, unless
    ``--quiet``) one line ending in the checksum."""
    args = parse_args(argv)
    if args.quiet:
        logger.disable("wf_mesh")
    try:
        with wf_mesh.init_from_env(wf_mesh.ParallelDims(cp=args.cp)) as session, torch.no_grad():
            result = generate(args, session.mesh)
            if dist.get_rank() == 0 and not args.quiet:
                shape = tuple(result["video"].shape)
                print(f"generate_video_dit: cp {result['cp']}, video {shape}, checksum {result['checksum']:.12e}")
            return result
    finally:
        if args.quiet:
            logger.enable("wf_mesh")


if __name__ == "__main__":
    main(sys.argv[1:])
