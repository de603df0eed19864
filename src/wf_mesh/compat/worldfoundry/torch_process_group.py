"""``worldfoundry.core.distributed.torch_process_group``: rank / world-size helpers that also work without
torch.distributed, ``barrier``, and the ``rank0_only`` / ``rank0_first`` decorators."""

from wf_mesh.legacy.process import (
    barrier,
    device_with_rank,
    get_rank,
    get_world_size,
    is_local_rank0,
    is_rank0,
    rank0_first,
    rank0_only,
)

__all__ = [
    "barrier",
    "device_with_rank",
    "get_rank",
    "get_world_size",
    "is_local_rank0",
    "is_rank0",
    "rank0_first",
    "rank0_only",
]
