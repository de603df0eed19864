"""``worldfoundry.core.distributed.model_parallel_groups``: initialize / destroy model parallel and every
group accessor; all of it is :mod:`wf_mesh.parallel_state` (MAGI-1 positional arguments, Megatron keywords)."""

from wf_mesh import parallel_state as _parallel_state
from wf_mesh.parallel_state import *  # noqa: F403 - the accessors, exactly parallel_state.__all__

__all__ = list(_parallel_state.__all__)

# Megatron's module globals (``_TENSOR_MODEL_PARALLEL_GROUP``, ...) read live here too (PEP 562)
__getattr__ = _parallel_state.__getattr__
