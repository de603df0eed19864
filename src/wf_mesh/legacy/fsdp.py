"""``hsdp_device_mesh`` of ``worldfoundry.core.distributed.fsdp_runtime``: the 2-D ``("replicate", "shard")``
DeviceMesh over the whole world for HSDP ``fully_shard``, taken from the one mesh where it can be.

The original builds ``init_device_mesh(device, (replicas, shard_size))``: shard groups are blocks of
consecutive ranks, replicate groups take every ``shard_size``-th rank. When the current
:class:`~wf_mesh.mesh.ParallelMesh` was built with ``dp_replicate`` and its HSDP view
(:meth:`~wf_mesh.mesh.ParallelMesh.hsdp_mesh`) has exactly those groups (tp = pp = 1, dp and cp in the default
order), that view is returned: no new process group. Otherwise the mesh is built once per
``(replicas, shard size, device)`` with the default group's timeout, kept for later calls, and destroyed
together with the model-parallel state (``destroy_model_parallel()``, ``ParallelMesh.destroy()``), with or
without a current mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from wf_mesh import _compat, agreement
from wf_mesh import mesh as native_mesh
from wf_mesh.mesh import DEVICE_TYPES, parallel_mesh_or_none, register_extension
from wf_mesh.topology import ParallelDims, as_int

__all__ = ["hsdp_device_mesh", "hsdp_rank_grid", "hsdp_sizes"]

DEFAULT_MAX_SHARD = 8

_meshes: dict[tuple[int, int, str], DeviceMesh] = {}


def _release(destroy_process_groups: bool) -> None:
    meshes = list(_meshes.values())
    _meshes.clear()
    for mesh in meshes:
        _compat.release_meshes(mesh, [], destroy_groups=destroy_process_groups)


register_extension("legacy.hsdp_meshes", _release)


def hsdp_sizes(
    world_size: int, replica_group_size: int | None = None, sharding_group_size: int | None = None
) -> tuple[int, int]:
    """``(replicas, shard size)`` as the original resolves them; pure.

    The shard size defaults to ``min(world_size, 8)`` and is capped at the world size; the replica count
    defaults to ``world_size // shard size``.

    Returns:
        ``(replicas, shard size)``.

    Raises:
        ValueError: the shard size does not divide the world, replicas x shard size is not the world size, or a
            size below 1.
        TypeError: a size that is not an int.
    """
    if sharding_group_size is None:
        shard = min(world_size, DEFAULT_MAX_SHARD)
    else:
        shard = min(as_int("sharding_group_size", sharding_group_size, minimum=1), world_size)
    if world_size % shard:
        raise ValueError(f"world size {world_size} is not divisible by the sharding group size {shard}")
    if replica_group_size is None:
        replicas = world_size // shard
    else:
        replicas = as_int("replica_group_size", replica_group_size, minimum=1)
    if replicas * shard != world_size:
        raise ValueError(
            f"replica_group_size={replicas} x sharding group size {shard} = {replicas * shard} is not the world "
            f"size {world_size}; the HSDP mesh spans every rank (leave replica_group_size=None to infer it)"
        )
    return replicas, shard


def hsdp_rank_grid(replicas: int, shard: int) -> torch.Tensor:
    """Global ranks of the HSDP mesh, shape ``(replicas, shard)``: row i is a shard group, column j a
    replicate group (the original's ``init_device_mesh`` layout); pure.

    It is :func:`wf_mesh.mesh.hsdp_rank_grid` of a pure data-parallel world: shard groups are consecutive ranks.

    Args:
        replicas: the number of replicas.
        shard: ranks per shard group.

    Returns:
        An int64 tensor of global ranks.
    """
    world = ParallelDims(dp=replicas * shard).resolve(replicas * shard)
    (grid,) = native_mesh.hsdp_rank_grid(world, replicas)
    return grid


def _device_type(device: str | torch.device | None) -> str:
    if device is None:
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind not in DEVICE_TYPES:
        raise ValueError(f"device={device!r}: use one of {list(DEVICE_TYPES)} (or None: the default group's)")
    return kind


@dataclasses.dataclass(frozen=True)
class _HsdpFacts(agreement.Facts):
    replicas: int
    shard: int = agreement.fact(label="shard size")
    device: str = agreement.fact(choices=DEVICE_TYPES)


def hsdp_device_mesh(
    replica_group_size: int | None = None,
    sharding_group_size: int | None = None,
    device: str | torch.device | None = None,
) -> DeviceMesh:
    """The ``("replicate", "shard")`` DeviceMesh over every rank (module docstring); collective.

    Args:
        replica_group_size: number of replicas (default: world size // shard size).
        sharding_group_size: ranks per shard group (default ``min(world_size, 8)``, capped at the world size).
        device: ``"cpu"`` or ``"cuda"`` (a device index is ignored); default None: ``"cuda"`` when the default
            group uses NCCL, else ``"cpu"`` (the original defaulted to ``"cuda"``).

    Returns:
        The 2-D DeviceMesh (row i a shard group, column j a replicate group): the current mesh's HSDP view when
        it has this layout, else one made once per layout and reused while it lives.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: sizes that do not fit the world, or an unknown device (on every rank, before any group is
            created).
        TypeError: a size that is not an int (on every rank, before any group is created).
        DisagreementError: ranks pass different arguments (on every rank, before any group is created).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "hsdp_device_mesh needs torch.distributed: call wf_mesh.dist_init(config) or "
            "torch.distributed.init_process_group(...) first"
        )
    world = dist.get_world_size()

    def facts() -> _HsdpFacts:
        replicas, shard = hsdp_sizes(world, replica_group_size, sharding_group_size)
        return _HsdpFacts(replicas=replicas, shard=shard, device=_device_type(device))

    world_group: Any = dist.group.WORLD
    agreed = agreement.agree(world_group, facts, what="hsdp_device_mesh", required=True)
    agreed.require_same("replicas", "shard", "device", hint="; every rank must pass the same arguments")
    mine = agreed.mine
    assert mine is not None  # required: the exchange ran and this rank's facts are known
    replicas, shard, kind = mine.replicas, mine.shard, mine.device
    grid = hsdp_rank_grid(replicas, shard)
    current = parallel_mesh_or_none()
    if current is not None and current.hsdp_enabled:
        view = current.hsdp_mesh()
        if view.device_type == kind and view.mesh.shape == grid.shape and torch.equal(view.mesh.cpu(), grid):
            return view
    key = (replicas, shard, kind)
    cached = _meshes.get(key)
    if cached is not None and _compat.mesh_is_live(cached):
        return cached
    options = _compat.backend_options(dist.get_backend(), _compat.default_group_timeout())
    # a dim spanning the world gets no options: torch then reuses the default group for it
    override: Any = {name: options for name, size in (("replicate", replicas), ("shard", shard)) if size != world}
    mesh = init_device_mesh(
        kind,
        (replicas, shard),
        mesh_dim_names=("replicate", "shard"),
        backend_override=(override if options is not None and override else None),
    )
    _meshes[key] = mesh
    return mesh
