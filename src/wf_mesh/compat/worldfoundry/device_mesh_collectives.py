"""``worldfoundry.core.distributed.device_mesh_collectives``: the legacy EMA, DTensor local shards, model-state
broadcast, and tensor broadcasts over a 1-D DeviceMesh."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wf_mesh.collectives import broadcast as _broadcast
from wf_mesh.legacy.ema import DTensorFastEmaModelUpdater, get_local_tensor_if_dtensor
from wf_mesh.state_sync import broadcast_dtensor_model_states

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "DTensorFastEmaModelUpdater",
    "FastEmaModelUpdater",
    "broadcast",
    "broadcast_dtensor_model_states",
    "broadcast_with_shape_check",
    "get_local_tensor_if_DTensor",
    "get_local_tensor_if_dtensor",
]

FastEmaModelUpdater = DTensorFastEmaModelUpdater
get_local_tensor_if_DTensor = get_local_tensor_if_dtensor


def broadcast(tensor: torch.Tensor, cp_or_tp_mesh: DeviceMesh) -> torch.Tensor:
    """``wf_mesh.broadcast(tensor, cp_or_tp_mesh.get_group())`` over a 1-D mesh.

    Returns:
        The mesh's first rank's tensor, on every rank (receivers get it on the group's device, in the source's
        shape: receivers' tensors need only the same ndim and dtype); ``tensor`` itself on a one-rank mesh.
    """
    return _broadcast(tensor, cp_or_tp_mesh.get_group())


broadcast_with_shape_check = broadcast
"""The original resized receivers whose shape differs from the source's; :func:`broadcast` always does."""
