"""``worldfoundry.core.distributed.logging``: ``print_rank_0`` / ``print_per_rank`` and the rank-aware loguru
``log`` (``log.info(message, *args, rank0_only=False)``); records carry the rank and mesh coordinates."""

from wf_mesh.legacy.log import log
from wf_mesh.log import print_per_rank, print_rank_0

__all__ = ["log", "print_per_rank", "print_rank_0"]
