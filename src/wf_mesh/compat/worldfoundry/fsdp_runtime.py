"""``worldfoundry.core.distributed.fsdp_runtime``: ``hsdp_device_mesh``, the ``("replicate", "shard")``
DeviceMesh for HSDP (the current mesh's HSDP view when it has the same groups)."""

from wf_mesh.legacy.fsdp import hsdp_device_mesh

__all__ = ["hsdp_device_mesh"]
