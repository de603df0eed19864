"""Make every replica of a model identical: broadcast parameters and buffers over a replicate axis.

With HSDP each shard of the model lives on ``R`` ranks (one per replica) that must start equal, e.g. after
each rank built and initialized its model from its own seed. :func:`broadcast_dtensor_model_states` sends
every local shard (parameters, then buffers) from the first global rank of this rank's replicate group to
the others and copies it back in place. Tensors are coalesced per (device, dtype) into buckets of at most
``bucket_bytes`` (a tensor larger than that travels alone), so the collectives issued are one per bucket,
not one per tensor, plus one tiny all-gather that checks every replica holds the same layout. CPU tensors
are broadcast as they are (gloo); nothing is moved to another device.

    pm = init_parallel(ParallelDims(cp=2), dp_replicate=2)
    fully_shard(model, mesh=pm.hsdp_mesh())
    broadcast_dtensor_model_states(model, pm.hsdp_mesh())   # or a DeviceMesh with a "replicate" axis
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from wf_mesh.ema import _require_resharded, get_local_tensor_if_dtensor
from wf_mesh.mesh import ParallelMesh

__all__ = ["DEFAULT_BUCKET_BYTES", "broadcast_dtensor_model_states", "plan_buckets"]

DEFAULT_BUCKET_BYTES = 32 * 2**20
"""Default bucket cap of :func:`broadcast_dtensor_model_states` (bytes)."""


def _model_states(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers, as local shards."""
    for name, tensor in model.named_parameters():
        yield name, get_local_tensor_if_dtensor(tensor).detach()
    for name, tensor in model.named_buffers():
        yield name, get_local_tensor_if_dtensor(tensor)


def plan_buckets(tensors: list[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets: one (device, dtype) per bucket, in order, each holding at
    most ``bucket_bytes`` (a larger tensor is a bucket of its own). Empty tensors are left out. Pure."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    open_buckets: dict[tuple, tuple[list[int], list[int]]] = {}  # key -> (indices, [bytes])
    buckets: list[list[int]] = []
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if not nbytes:
            continue
        key = (t.device, t.dtype)
        current = open_buckets.get(key)
        if current is None or current[1][0] + nbytes > bucket_bytes:
            current = ([], [0])
            open_buckets[key] = current
            buckets.append(current[0])
        current[0].append(i)
        current[1][0] += nbytes
    return buckets


def _replicate_group(mesh: DeviceMesh | ParallelMesh, axis: str) -> dist.ProcessGroup:
    names = mesh.axes if isinstance(mesh, ParallelMesh) else (mesh.mesh_dim_names or ())
    if axis not in names:
        raise ValueError(
            f"broadcast_dtensor_model_states: the mesh has no axis {axis!r} (axes: {list(names)}); pass "
            "replicate_axis=<the name of the replica axis>, or build the HSDP view with "
            "init_parallel(dims, dp_replicate=R) and pass mesh.hsdp_mesh()"
        )
    return mesh.group(axis) if isinstance(mesh, ParallelMesh) else mesh.get_group(axis)


def _check_same_layout(names: list[str], tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """One all-gather of (count, elements, layout hash): a clear error on every rank instead of a hang."""
    layout = repr([(n, str(t.dtype), tuple(t.shape)) for n, t in zip(names, tensors)]).encode()
    device = tensors[0].device if tensors else torch.device("cpu")
    mine = torch.tensor([len(tensors), sum(t.numel() for t in tensors), zlib.crc32(layout)], device=device)
    every = torch.empty(group.size() * 3, dtype=mine.dtype, device=device)
    dist.all_gather_single(every, mine, group=group)
    every = every.view(-1, 3)
    if not bool((every == mine).all()):
        ranks = dist.get_process_group_ranks(group)
        seen = {r: tuple(v) for r, v in zip(ranks, every.tolist())}
        raise ValueError(
            "broadcast_dtensor_model_states: the replicas differ (global rank -> (tensors, elements, layout "
            f"hash)): {seen}; every rank of a replicate group must hold the same parameters and buffers, "
            "sharded the same way"
        )


@torch.no_grad()
def broadcast_dtensor_model_states(
    model: nn.Module,
    mesh: DeviceMesh | ParallelMesh,
    *,
    replicate_axis: str = "replicate",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Copy the model states of the first global rank of each replicate group to the rest of that group.

    Parameters then buffers, local shards of DTensors, in place. A replicate axis of size 1 is a no-op.
    Collective over the replicate axis: every rank of the mesh must call it.

    Args:
        model: the (possibly FSDP2-sharded) model; every replica must have the same layout.
        mesh: a DeviceMesh with an axis named ``replicate_axis`` (:meth:`ParallelMesh.hsdp_mesh`, or
            ``init_device_mesh(..., mesh_dim_names=("replicate", "shard"))``), or a ParallelMesh built with
            ``dp_replicate``.
        replicate_axis: name of the axis whose ranks hold the same shards.
        bucket_bytes: cap of one coalesced broadcast.

    Returns:
        The number of broadcasts issued (the buckets; 0 for a size-1 axis).

    Raises:
        ValueError: ``bucket_bytes < 1`` or no such axis (before any collective); the replicas' layouts differ
            (raised on every rank of the group).
        RuntimeError: FSDP2 holds parameters unsharded (after forward, before backward): the broadcast would
            write copies that FSDP2 then discards.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    group = _replicate_group(mesh, replicate_axis)
    if group.size() == 1:
        return 0
    _require_resharded(model, "broadcast_dtensor_model_states: the model")
    named = list(_model_states(model))
    names, tensors = [n for n, _ in named], [t for _, t in named]
    _check_same_layout(names, tensors, group)
    source = dist.get_group_rank(group, dist.get_rank()) == 0  # group rank 0 = the smallest global rank
    buckets = plan_buckets(tensors, bucket_bytes)
    for bucket in buckets:
        members = [tensors[i] for i in bucket]
        if len(members) == 1 and members[0].is_contiguous():
            dist.broadcast(members[0], group=group, group_src=0)
            continue
        if source:
            flat = torch.cat([t.reshape(-1) for t in members])
        else:
            flat = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype, device=members[0].device)
        dist.broadcast(flat, group=group, group_src=0)
        if not source:
            views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in members]), members)]
            torch._foreach_copy_(members, views)
    return len(buckets)
