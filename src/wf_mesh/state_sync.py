"""Make every replica of a model identical: broadcast parameters and buffers over a replicate axis.

With HSDP each shard of the model lives on ``R`` ranks (one per replica) that must start equal, e.g. after
each rank built and initialized its model from its own seed. :func:`broadcast_dtensor_model_states` sends
every local shard (parameters, then buffers) from the first global rank of this rank's replicate group to
the others and copies it back in place. Tensors are coalesced per (device, dtype) into buckets of at most
``bucket_bytes`` (a tensor larger than that travels alone), so the collectives issued are one per bucket,
not one per tensor, plus one tiny agreement all-gather. CPU tensors are broadcast as they are (gloo);
nothing is moved to another device.

Before any data moves, every rank checks that each DTensor it holds is REPLICATED over the replicate group it
was given (the group's ranks hold the same shard of it: its placements are Replicate on the mesh dims along
which those ranks differ) and the ranks agree on the layout (names, dtypes, shapes) and ``bucket_bytes``. A
mismatch, e.g. a model sharded with ``fully_shard(model, mesh=pm.fsdp_mesh())`` over dp x cp and then given
``pm.hsdp_mesh()`` (whose replicate ranks hold DIFFERENT shards of it), raises on every rank naming the
parameter, its placements and mesh, and the mesh given: copying shards between those ranks would silently
corrupt the weights.

    pm = init_parallel(ParallelDims(cp=2), dp_replicate=2)
    fully_shard(model, mesh=pm.hsdp_mesh())
    broadcast_dtensor_model_states(model, pm.hsdp_mesh())   # or a DeviceMesh with a "replicate" axis
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from wf_mesh import _compat, agreement, waits
from wf_mesh.ema import local_shard
from wf_mesh.faults import FaultSequence
from wf_mesh.mesh import ParallelMesh
from wf_mesh.topology import as_int

__all__ = ["DEFAULT_BUCKET_BYTES", "broadcast_dtensor_model_states"]

DEFAULT_BUCKET_BYTES = 32 * 2**20
"""Default bucket cap of :func:`broadcast_dtensor_model_states` (bytes)."""


def _model_states(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers (name, tensor as registered: DTensor or plain)."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def plan_buckets(tensors: list[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Group ``tensors`` into buckets: one (device, dtype) per bucket, in order, each holding at most
    ``bucket_bytes`` (a larger tensor is a bucket of its own). Empty tensors are left out. Pure.

    Returns:
        The indices into ``tensors`` of each bucket, in order.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
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
    if not isinstance(mesh, (DeviceMesh, ParallelMesh)):
        raise TypeError(
            f"broadcast_dtensor_model_states: mesh must be a DeviceMesh or a ParallelMesh, got {type(mesh).__name__}"
        )
    names = mesh.axes if isinstance(mesh, ParallelMesh) else (mesh.mesh_dim_names or ())
    if axis not in names:
        raise ValueError(
            f"broadcast_dtensor_model_states: the mesh has no axis {axis!r} (axes: {list(names)}); pass "
            "replicate_axis=<the name of the replica axis>, or build the HSDP view with "
            "init_parallel(dims, dp_replicate=R) and pass mesh.hsdp_mesh()"
        )
    return mesh.group(axis) if isinstance(mesh, ParallelMesh) else mesh.get_group(axis)


def _replica_problem(name: str, tensor: DTensor, replicas: list[int], given: str, memo: dict) -> str | None:
    """Why ``tensor`` is not replicated over the global ranks ``replicas`` (None if it is)."""
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    key = (id(mesh), placements)
    if key not in memo:
        grid, coords = mesh.mesh, mesh.get_coordinate()
        assert coords is not None, "this rank holds the DTensor, so it is on its mesh"
        same = torch.ones_like(grid, dtype=torch.bool)  # ranks that hold the same local data as this one
        for dim, placement in enumerate(placements):
            if not isinstance(placement, Replicate):
                index: list[slice | int] = [slice(None)] * grid.ndim
                index[dim] = coords[dim]
                mask = torch.zeros_like(same)
                mask[tuple(index)] = True
                same &= mask
        holders = set(grid[same].tolist())
        memo[key] = sorted(set(replicas) - holders)
    outsiders = memo[key]
    if not outsiders:
        return None
    return (
        f"parameter or buffer {name!r} is a DTensor with placements {placements} on {mesh} (mesh ranks "
        f"{mesh.mesh.tolist()}): replicate group ranks {outsiders} of {replicas} ({given}) hold other data for it, "
        "so copying from the group's first rank would overwrite their shards; pass a mesh whose replicate axis "
        "runs along dims where the model is Replicate (for fully_shard(model, mesh=pm.hsdp_mesh()) pass "
        "pm.hsdp_mesh(); a model sharded over pm.fsdp_mesh() has no replicas to broadcast between)"
    )


@dataclasses.dataclass(frozen=True)
class _ReplicaFacts(agreement.Facts):
    bucket_bytes: int
    tensors: int
    elements: int
    layout_crc: int
    """crc32 of every tensor's name, dtype and local shape."""


def _replica_facts(
    named: list[tuple[str, torch.Tensor]], replicas: list[int], given: str, bucket_bytes: int
) -> _ReplicaFacts:
    size = as_int("bucket_bytes", bucket_bytes, minimum=1)
    memo: dict = {}
    for name, tensor in named:
        if isinstance(tensor, DTensor) and (problem := _replica_problem(name, tensor, replicas, given, memo)):
            raise ValueError(problem)
    layout = repr([(n, str(t.dtype), tuple(local_shard(t).shape)) for n, t in named]).encode()
    return _ReplicaFacts(size, len(named), sum(local_shard(t).numel() for _, t in named), zlib.crc32(layout))


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

    Raises (on every rank of the replicate group, before any data moves):
        ValueError: no such axis; a DTensor that is not replicated over the replicate group (module
            docstring); ``bucket_bytes < 1``.
        DisagreementError: the replicas' layouts or ``bucket_bytes`` differ.

    FSDP2 modules left unsharded by a forward are resharded first (the broadcast writes shards).
    """
    group = _replicate_group(mesh, replicate_axis)
    if group.size() == 1:
        return 0
    _compat.reshard_fsdp_modules(model)  # the broadcast writes shards; unsharded copies would be discarded
    named = list(_model_states(model))
    replicas = dist.get_process_group_ranks(group)
    given = f"axis {replicate_axis!r} of the mesh given"

    agreed = agreement.agree(
        group,
        lambda: _replica_facts(named, replicas, given, bucket_bytes),
        what="broadcast_dtensor_model_states",
        required=True,
    )
    agreed.require_same("bucket_bytes")
    agreed.require_same(
        key=lambda r: (r.tensors, r.elements, f"{r.layout_crc:08x}"),
        label="the model layout (tensors, elements, crc of names/dtypes/shapes)",
        hint="; every rank of a replicate group must hold the same parameters and buffers, sharded the same way",
    )
    tensors = [local_shard(t).detach() for _, t in named]
    source = dist.get_group_rank(group, dist.get_rank()) == 0  # group rank 0 = the smallest global rank
    buckets = plan_buckets(tensors, bucket_bytes)
    seq, n = FaultSequence(group, "broadcast_dtensor_model_states"), len(buckets)
    for b, bucket in enumerate(buckets, 1):
        members = [tensors[i] for i in bucket]
        if len(members) == 1 and members[0].is_contiguous():
            with waits.bounded(group, "broadcast_dtensor_model_states"):
                dist.broadcast(members[0], group=group, group_src=0)
            continue
        flat = seq.step(("bucket", b, n), _bucket_buffer, members)
        if flat is None:  # contained failure: the peers still expect this bucket's message
            flat = _bucket_buffer(members)
        elif source:
            seq.step(("bucket", b, n), _copy_in, members, flat)
        with waits.bounded(group, "broadcast_dtensor_model_states"):
            dist.broadcast(flat, group=group, group_src=0)
        if not source:
            seq.step(("bucket", b, n), _copy_out, members, flat)
    seq.close()
    return len(buckets)


def _bucket_buffer(members: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype, device=members[0].device)


def _copy_in(members: list[torch.Tensor], flat: torch.Tensor) -> None:
    torch.cat([t.reshape(-1) for t in members], out=flat)


def _copy_out(members: list[torch.Tensor], flat: torch.Tensor) -> None:
    views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in members]), members)]
    _compat.foreach_copy_(members, views)
