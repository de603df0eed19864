"""``worldfoundry.core.distributed.inference_runtime``: ``dist_init`` (torch.distributed and the mesh from a
config), the last-rank predicates, and ``get_device(local_rank=None)``."""

from wf_mesh.legacy.process import get_device
from wf_mesh.legacy.runtime import dist_init, is_last_rank, is_last_tp_cp_rank

__all__ = ["dist_init", "get_device", "is_last_rank", "is_last_tp_cp_rank"]
