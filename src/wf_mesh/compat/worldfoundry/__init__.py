"""``worldfoundry.core.distributed`` on wf_mesh: the same module tree and names, thin aliases of wf_mesh.

Migrate by replacing the import prefix ``worldfoundry.core.distributed`` with ``wf_mesh.compat.worldfoundry``;
code that cannot edit its imports calls :func:`install` once, before importing them.

Modules: ``context_parallel``, ``device_mesh_collectives``, ``model_parallel_groups``, ``pipeline_parallel``,
``inference_runtime``, ``logging``, ``megatron_compat``, ``torch_process_group``, ``fsdp_runtime``. Behaviour
and deliberate differences: docs/design.md, "Legacy contract".
"""

from __future__ import annotations

import types

from wf_mesh.compat.worldfoundry.context_parallel import (
    broadcast,
    broadcast_split_tensor,
    cat_outputs_cp,
    cat_outputs_cp_object_list,
    cat_outputs_cp_with_grad,
    find_split,
    robust_broadcast,
    split_inputs_cp,
    split_inputs_cp_object_list,
)
from wf_mesh.compat.worldfoundry.device_mesh_collectives import (
    DTensorFastEmaModelUpdater,
    FastEmaModelUpdater,
    broadcast_dtensor_model_states,
    get_local_tensor_if_DTensor,
    get_local_tensor_if_dtensor,
)
from wf_mesh.compat.worldfoundry.inference_runtime import dist_init, is_last_rank, is_last_tp_cp_rank
from wf_mesh.compat.worldfoundry.inference_runtime import get_device as get_distributed_device
from wf_mesh.compat.worldfoundry.logging import print_per_rank, print_rank_0
from wf_mesh.compat.worldfoundry.model_parallel_groups import (
    destroy_model_parallel,
    get_cp_group,
    get_cp_rank,
    get_cp_world_size,
    get_dp_group,
    get_dp_group_gloo,
    get_dp_rank,
    get_dp_world_size,
    get_model_parallel_group,
    get_pipeline_model_parallel_first_rank,
    get_pipeline_model_parallel_last_rank,
    get_pipeline_model_parallel_next_rank,
    get_pipeline_model_parallel_prev_rank,
    get_pp_group,
    get_pp_rank,
    get_pp_world_size,
    get_tensor_model_parallel_last_rank,
    get_tensor_model_parallel_ranks,
    get_tensor_model_parallel_src_rank,
    get_tp_group,
    get_tp_rank,
    get_tp_world_size,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from wf_mesh.compat.worldfoundry.pipeline_parallel import PPScheduler, init_pp_scheduler, pp_scheduler
from wf_mesh.legacy.module_alias import install_alias
from wf_mesh.legacy.process import get_rank as get_global_rank
from wf_mesh.legacy.process import get_world_size
from wf_mesh.legacy.process import is_initialized as is_distributed_initialized

__all__ = [
    "DTensorFastEmaModelUpdater",
    "FastEmaModelUpdater",
    "PPScheduler",
    "broadcast",
    "broadcast_dtensor_model_states",
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_object_list",
    "cat_outputs_cp_with_grad",
    "destroy_model_parallel",
    "dist_init",
    "find_split",
    "get_cp_group",
    "get_cp_rank",
    "get_cp_world_size",
    "get_distributed_device",
    "get_dp_group",
    "get_dp_group_gloo",
    "get_dp_rank",
    "get_dp_world_size",
    "get_global_rank",
    "get_local_tensor_if_DTensor",
    "get_local_tensor_if_dtensor",
    "get_model_parallel_group",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pp_group",
    "get_pp_rank",
    "get_pp_world_size",
    "get_tensor_model_parallel_last_rank",
    "get_tensor_model_parallel_ranks",
    "get_tensor_model_parallel_src_rank",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_world_size",
    "get_world_size",
    "init_pp_scheduler",
    "initialize_model_parallel",
    "install",
    "is_distributed_initialized",
    "is_last_rank",
    "is_last_tp_cp_rank",
    "model_parallel_is_initialized",
    "pp_scheduler",
    "print_per_rank",
    "print_rank_0",
    "robust_broadcast",
    "split_inputs_cp",
    "split_inputs_cp_object_list",
]

ORIGINAL_NAME = "worldfoundry.core.distributed"


def install() -> types.ModuleType:
    """Register this tree as ``worldfoundry.core.distributed`` (and each submodule) in ``sys.modules``, with
    the parent packages ``worldfoundry`` and ``worldfoundry.core`` (the real ones when they exist, else empty
    ones), so that the original imports load wf_mesh. Idempotent.

    Returns:
        This package.

    Raises:
        ImportError: (naming the module and its file) a different ``worldfoundry.core.distributed`` (or
            submodule) is already imported; nothing is registered then.
    """
    return install_alias(ORIGINAL_NAME, __name__)
