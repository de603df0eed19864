"""The legacy layer: the function API of ``worldfoundry.core.distributed`` on top of the native features.

Everything here maps legacy arguments (ProcessGroups, ``None`` meaning "parallelism off", two-model EMA,
config objects) onto the native API, and owns the legacy process-wide state (the PP scheduler singleton,
cached group meshes, ``cp_size_t``, Megatron's overrides and groups, HSDP meshes), each registered with the mesh
as a named extension (:func:`wf_mesh.mesh.register_extension`) so that destroying the mesh resets it. Native
modules never import it, and it never imports the faces above it: the 20 legacy names are re-exported from
:mod:`wf_mesh`, the Megatron / MAGI accessors live in :mod:`wf_mesh.parallel_state`, and
:mod:`wf_mesh.compat.worldfoundry` mirrors the original module tree for drop-in imports. The legacy
AssertionError contract is :mod:`wf_mesh.legacy.errors`.
"""

from wf_mesh.legacy.context_parallel import (
    broadcast_split_tensor,
    cat_outputs_cp,
    cat_outputs_cp_object_list,
    cat_outputs_cp_with_grad,
    find_split,
    mesh_for_group,
    robust_broadcast,
    split_inputs_cp,
    split_inputs_cp_object_list,
)
from wf_mesh.legacy.ema import DTensorFastEmaModelUpdater, get_local_tensor_if_dtensor
from wf_mesh.legacy.pipeline import PPScheduler, init_pp_scheduler, pp_scheduler, pp_scheduler_or_none
from wf_mesh.legacy.runtime import dist_init, get_device, is_last_rank, is_last_tp_cp_rank

__all__ = [
    "DTensorFastEmaModelUpdater",
    "PPScheduler",
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_object_list",
    "cat_outputs_cp_with_grad",
    "dist_init",
    "find_split",
    "get_device",
    "get_local_tensor_if_dtensor",
    "init_pp_scheduler",
    "is_last_rank",
    "is_last_tp_cp_rank",
    "mesh_for_group",
    "pp_scheduler",
    "pp_scheduler_or_none",
    "robust_broadcast",
    "split_inputs_cp",
    "split_inputs_cp_object_list",
]
