"""wf_mesh: one DeviceMesh with named axes tp/cp/pp/dp for video / world-model training and serving.

Native API (mesh first):
    ParallelDims           pure topology: degrees, order, rank <-> coordinates, groups (no processes needed)
    init_parallel          build the ParallelMesh (one init_device_mesh + derived axes) and make it current
    get_parallel_mesh      the current mesh (raises if none); parallel_mesh_or_none() returns None instead
    ParallelMesh           mesh[axis] -> DeviceMesh, .group/.rank/.size/.ranks(axis), .destroy()

Legacy API (drop-in for ``worldfoundry.core.distributed`` and Megatron/MAGI ``parallel_state``):
    initialize_model_parallel, destroy_model_parallel, model_parallel_is_initialized, dist_init,
    is_last_rank, is_last_tp_cp_rank, print_rank_0, print_per_rank, and wf_mesh.parallel_state accessors.
"""

from wf_mesh import parallel_state
from wf_mesh.legacy import is_last_rank, is_last_tp_cp_rank
from wf_mesh.log import print_per_rank, print_rank_0
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh, init_parallel, parallel_mesh_or_none
from wf_mesh.parallel_state import (
    destroy_model_parallel,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from wf_mesh.runtime import dist_init
from wf_mesh.topology import AXES, DERIVED_AXES, ParallelDims

__version__ = "0.1.0"

__all__ = [
    # native
    "AXES",
    "DERIVED_AXES",
    "ParallelDims",
    "ParallelMesh",
    "get_parallel_mesh",
    "init_parallel",
    "parallel_mesh_or_none",
    "parallel_state",
    # legacy
    "destroy_model_parallel",
    "dist_init",
    "initialize_model_parallel",
    "is_last_rank",
    "is_last_tp_cp_rank",
    "model_parallel_is_initialized",
    "print_per_rank",
    "print_rank_0",
]
