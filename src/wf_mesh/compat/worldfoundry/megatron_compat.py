"""``worldfoundry.core.distributed.megatron_compat``: ``parallel_state`` (and ``mpu``) is
:mod:`wf_mesh.parallel_state` itself, ``cp_size_t`` included (set by ``find_split``)."""

from wf_mesh import parallel_state

mpu = parallel_state

__all__ = ["mpu", "parallel_state"]
