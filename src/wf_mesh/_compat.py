"""The one module that touches private torch API or depends on torch internals.

Everything here is a small, named shim so that a torch upgrade is fixed in one place:

- ``flatten``: ``DeviceMesh._flatten`` builds a 1-D mesh (and its process groups) over several axes.
- ``backend_options``: per-group options (``ProcessGroupGloo._Options``, ``ProcessGroupNCCL.Options``) carrying
  the timeout; ``new_group`` otherwise falls back to torch's global 30-minute default, not the timeout the
  default group was created with.
- ``release_meshes``: destroys the process groups a set of meshes created, and breaks the reference
  cycle between a root DeviceMesh and its flattened children (``root._flatten_mapping`` <->
  ``child._root_mesh``). Until every reference is dropped, gloo groups keep their sockets open even after
  ``destroy_process_group``, so repeated init/destroy would leak file descriptors.
- ``register_fake_backend``: the ``fake`` backend (one process pretending to be rank r of N) is
  registered by a module under ``torch.testing._internal``.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "backend_options",
    "destroy_subgroups",
    "flatten",
    "mesh_group_names",
    "register_fake_backend",
    "release_meshes",
]

NCCL_OPTION_KEYS = ("cga_cluster_size", "max_ctas", "min_ctas")


def flatten(submesh: DeviceMesh, name: str, options: Any | None = None) -> DeviceMesh:
    """Flatten ``submesh`` (sliced from a root mesh) into a 1-D mesh called ``name``; creates its groups."""
    return submesh._flatten(name, backend_override=options)


def backend_options(
    backend: str, timeout: datetime.timedelta, nccl_config: Mapping[str, int] | None = None
) -> Any | None:
    """Options object for one mesh axis's process groups on ``backend``, carrying ``timeout``.

    ``nccl_config`` holds NCCL communicator settings (``min_ctas``, ``max_ctas``, ``cga_cluster_size``).
    Returns None for backends without an options type (the global default timeout then applies).
    """
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        for key, value in (nccl_config or {}).items():
            setattr(opts.config, key, value)
    else:
        return None
    opts._timeout = timeout
    return opts


def mesh_group_names(mesh: DeviceMesh) -> list[str]:
    """Names of the process groups a mesh owns, one per mesh dim (empty if this rank is outside it)."""
    return list(getattr(mesh, "_dim_group_names", []))


def release_meshes(root: DeviceMesh, flattened: Iterable[DeviceMesh], destroy_groups: bool = True) -> None:
    """Destroy the process groups of ``root`` and its ``flattened`` meshes (never the default group)
    and break the root <-> child reference cycle so the groups' sockets close now."""
    flattened = list(flattened)
    if destroy_groups and dist.is_initialized():
        default = dist.group.WORLD
        seen: set[str] = set()
        for mesh in [root, *flattened]:
            for name in mesh_group_names(mesh):
                if name in seen:
                    continue
                seen.add(name)
                pg = dist.distributed_c10d._resolve_process_group(name)
                if pg is not None and pg is not default and pg != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(pg)
    for mesh in flattened:
        mesh._root_mesh = None
        mesh._pg_registry = {}
    root._flatten_mapping = {}
    root._pg_registry = {}


def register_fake_backend() -> None:
    """Register torch's ``fake`` backend (for topology checks at thousands of simulated ranks)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers on import)


def destroy_subgroups() -> None:
    """Destroy every process group except the default one (test clean-up between tests)."""
    if not dist.is_initialized():
        return
    default = dist.group.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is not default:
            dist.destroy_process_group(pg)
