"""wf_mesh: one DeviceMesh with named axes tp/cp/pp/dp for video / world-model training and serving.

Native API (mesh first):
    ParallelDims           pure topology: degrees, order, rank <-> coordinates, groups (no processes needed)
    init_parallel          build the ParallelMesh (one init_device_mesh + derived axes) and make it current
    get_parallel_mesh      the current mesh (raises if none); parallel_mesh_or_none() returns None instead
    ParallelMesh           mesh[axis] -> DeviceMesh, .group/.rank/.size/.ranks(axis), .destroy()

Context parallel (wf_mesh.context_parallel, wf_mesh.video):
    shard_sequence / gather_sequence / broadcast_shard   Replicate <-> Shard(seq_dim) on the cp axis
    find_split, plan_video_split -> VideoSplit           time-then-height CP plans for (B, C, T, H, W) latents

Shard-local model state for FSDP2 (wf_mesh.ema, wf_mesh.state_sync):
    ShardedEMA                       fp32 EMA of local shards; update(model), swapped_into(model), DCP state_dict
    ParallelMesh.fsdp_mesh/hsdp_mesh the dp_cp axis, or the ("replicate", "shard") view (init_parallel(dp_replicate=))

Pipeline (wf_mesh.pipeline):
    PipelineP2P                      send/recv between adjacent pp stages (ring), checked mode, batched exchange
    build_pipeline_stage             torch.distributed.pipelining.PipelineStage placed by the mesh

Seeing placements (wf_mesh.viz; text for terminals, HTML in notebooks):
    TopologyView / show_topology     the rank grid with each axis's groups told apart
    PlacementView                    which rank holds which slice of which dims (a DTensor, or .plan(...))

Legacy API (drop-in for ``worldfoundry.core.distributed`` and Megatron/MAGI ``parallel_state``):
    initialize_model_parallel, destroy_model_parallel, model_parallel_is_initialized, dist_init,
    is_last_rank, is_last_tp_cp_rank, print_rank_0, print_per_rank, split_inputs_cp, cat_outputs_cp,
    cat_outputs_cp_with_grad, broadcast, broadcast_split_tensor, find_split, DTensorFastEmaModelUpdater,
    get_local_tensor_if_dtensor, broadcast_dtensor_model_states, PPScheduler, init_pp_scheduler, pp_scheduler,
    and wf_mesh.parallel_state accessors.
"""

from wf_mesh import parallel_state
from wf_mesh.collectives import ShapeMismatchError, broadcast
from wf_mesh.context_parallel import (
    IndivisibleSequenceError,
    broadcast_shard,
    find_split,
    gather_sequence,
    mesh_for_group,
    shard_sequence,
)
from wf_mesh.ema import (
    DTensorFastEmaModelUpdater,
    ShardedEMA,
    get_local_tensor_if_dtensor,
)
from wf_mesh.legacy import (
    broadcast_split_tensor,
    cat_outputs_cp,
    cat_outputs_cp_with_grad,
    is_last_rank,
    is_last_tp_cp_rank,
    split_inputs_cp,
)
from wf_mesh.log import print_per_rank, print_rank_0
from wf_mesh.mesh import (
    ParallelMesh,
    get_parallel_mesh,
    init_parallel,
    parallel_mesh_or_none,
)
from wf_mesh.parallel_state import (
    destroy_model_parallel,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from wf_mesh.pipeline import (
    PipelineP2P,
    PipelineStateError,
    PPScheduler,
    build_pipeline_stage,
    init_pp_scheduler,
    pp_scheduler,
    pp_scheduler_or_none,
)
from wf_mesh.runtime import dist_init
from wf_mesh.state_sync import broadcast_dtensor_model_states
from wf_mesh.topology import AXES, DERIVED_AXES, ParallelDims
from wf_mesh.video import VideoSplit, plan_video_split
from wf_mesh.viz import PlacementView, TopologyView, show_topology

__version__ = "0.1.0"

__all__ = [
    # native
    "AXES",
    "DERIVED_AXES",
    "IndivisibleSequenceError",
    "ParallelDims",
    "ParallelMesh",
    "PipelineP2P",
    "PipelineStateError",
    "PlacementView",
    "ShapeMismatchError",
    "ShardedEMA",
    "TopologyView",
    "VideoSplit",
    "broadcast_shard",
    "build_pipeline_stage",
    "gather_sequence",
    "get_parallel_mesh",
    "init_parallel",
    "mesh_for_group",
    "parallel_mesh_or_none",
    "parallel_state",
    "plan_video_split",
    "pp_scheduler_or_none",
    "shard_sequence",
    "show_topology",
    # legacy
    "DTensorFastEmaModelUpdater",
    "PPScheduler",
    "broadcast",
    "broadcast_dtensor_model_states",
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_with_grad",
    "destroy_model_parallel",
    "dist_init",
    "find_split",
    "get_local_tensor_if_dtensor",
    "init_pp_scheduler",
    "initialize_model_parallel",
    "is_last_rank",
    "is_last_tp_cp_rank",
    "model_parallel_is_initialized",
    "print_per_rank",
    "pp_scheduler",
    "print_rank_0",
    "split_inputs_cp",
]
