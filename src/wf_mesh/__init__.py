"""wf_mesh: one DeviceMesh with named axes tp/cp/pp/cfg/dp for video / world-model training and serving.

Native API (mesh first):
    ParallelDims           pure topology: degrees, order, rank <-> coordinates, groups (no processes needed)
    init_from_env          start torch.distributed from torchrun / SLURM / nothing and build the mesh; a session
                           (context manager, close()) that tears down what it started
    init_parallel          build the ParallelMesh (one init_device_mesh + derived axes) and make it current
    get_parallel_mesh      the current mesh (raises if none); parallel_mesh_or_none() returns None instead
    ParallelMesh           mesh[axis] -> DeviceMesh, .group/.rank/.size/.ranks(axis), .generator(seed, vary_over),
                           .destroy()

Context parallel (wf_mesh.context_parallel, wf_mesh.video, wf_mesh.attention):
    shard_sequence / gather_sequence / broadcast_shard   Replicate <-> Shard(seq_dim) on the cp axis
    plan_video_split -> VideoSplit                       time, height, width CP plans: latents and their patch tokens
    cp_attention, CPSelfAttention                        exact attention over cp shards: ring, ulysses, usp
    plan_cp_attention -> CPAttentionPlan                 every shard's length agreed once per step (plan=)
    zigzag_shard / zigzag_gather                         the load-balanced layout for causal attention
    RangeMask                                            block-causal / packed / windowed masks as ranges;
                                                         plan_cp_attention(mask=...) balances their work
    KVCache -> KVCacheStep                               autoregressive decoding chunk by chunk: the chunk's
                                                         queries against the cp-sharded cache (split-KV)

Shard-local model state for FSDP2 (wf_mesh.ema, wf_mesh.state_sync):
    ShardedEMA                       fp32 EMA of local shards; update(model), swapped_into(model), DCP state_dict
    ParallelMesh.fsdp_mesh/hsdp_mesh the dp_cfg_cp axis, or the ("replicate", "shard") view (init_parallel(dp_replicate=))

Classifier-free guidance (wf_mesh.guidance):
    guided_prediction / split_branches   the cond and uncond branches in one process, or on the cfg axis (cfg=2)
    combine_guidance                     uncond + scale * (cond - uncond)

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

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it. Imported on first use, so that `import wf_mesh` (and the CLI's `plan`)
# does not pay for importing torch.
_EXPORTS: dict[str, str] = {
    # native
    "AXES": "wf_mesh.topology",
    "AXIS_TABLE": "wf_mesh.topology",
    "DERIVED_AXES": "wf_mesh.topology",
    "ParallelDims": "wf_mesh.topology",
    "ParallelMesh": "wf_mesh.mesh",
    "get_parallel_mesh": "wf_mesh.mesh",
    "init_parallel": "wf_mesh.mesh",
    "parallel_mesh_or_none": "wf_mesh.mesh",
    "DistributedSession": "wf_mesh.bootstrap",
    "LaunchEnv": "wf_mesh.bootstrap",
    "init_from_env": "wf_mesh.bootstrap",
    "DegreeError": "wf_mesh.errors",
    "CollectiveTimeoutError": "wf_mesh.errors",
    "DisagreementError": "wf_mesh.errors",
    "IndivisibleSequenceError": "wf_mesh.errors",
    "NotInitializedError": "wf_mesh.errors",
    "ShapeMismatchError": "wf_mesh.errors",
    "StateError": "wf_mesh.errors",
    "broadcast_shard": "wf_mesh.context_parallel",
    "gather_sequence": "wf_mesh.context_parallel",
    "combine_guidance": "wf_mesh.guidance",
    "guided_prediction": "wf_mesh.guidance",
    "split_branches": "wf_mesh.guidance",
    "shard_sequence": "wf_mesh.context_parallel",
    "VideoSplit": "wf_mesh.video",
    "CPAttentionPlan": "wf_mesh.attention_plan",
    "RangeMask": "wf_mesh.masks",
    "KVCache": "wf_mesh.kv_cache",
    "KVCacheStep": "wf_mesh.kv_cache",
    "CPSelfAttention": "wf_mesh.attention",
    "plan_cp_attention": "wf_mesh.attention_plan",
    "cp_attention": "wf_mesh.attention",
    "zigzag_gather": "wf_mesh.attention",
    "zigzag_shard": "wf_mesh.attention",
    "plan_video_split": "wf_mesh.video",
    "ShardedEMA": "wf_mesh.ema",
    "PipelineP2P": "wf_mesh.pipeline",
    "build_pipeline_stage": "wf_mesh.pipeline",
    "PlacementView": "wf_mesh.viz",
    "TopologyView": "wf_mesh.viz",
    "show_topology": "wf_mesh.viz",
    "broadcast_dtensor_model_states": "wf_mesh.state_sync",
    "print_per_rank": "wf_mesh.log",
    "print_rank_0": "wf_mesh.log",
    "broadcast": "wf_mesh.collectives",
    # legacy (wf_mesh.legacy, wf_mesh.parallel_state)
    "PipelineStateError": "wf_mesh.legacy.errors",
    "DTensorFastEmaModelUpdater": "wf_mesh.legacy.ema",
    "get_local_tensor_if_dtensor": "wf_mesh.legacy.ema",
    "broadcast_split_tensor": "wf_mesh.legacy.context_parallel",
    "cat_outputs_cp": "wf_mesh.legacy.context_parallel",
    "cat_outputs_cp_with_grad": "wf_mesh.legacy.context_parallel",
    "find_split": "wf_mesh.legacy.context_parallel",
    "mesh_for_group": "wf_mesh.legacy.context_parallel",
    "split_inputs_cp": "wf_mesh.legacy.context_parallel",
    "PPScheduler": "wf_mesh.legacy.pipeline",
    "init_pp_scheduler": "wf_mesh.legacy.pipeline",
    "pp_scheduler": "wf_mesh.legacy.pipeline",
    "pp_scheduler_or_none": "wf_mesh.legacy.pipeline",
    "dist_init": "wf_mesh.legacy.runtime",
    "is_last_rank": "wf_mesh.legacy.runtime",
    "is_last_tp_cp_rank": "wf_mesh.legacy.runtime",
    "destroy_model_parallel": "wf_mesh.parallel_state",
    "initialize_model_parallel": "wf_mesh.parallel_state",
    "model_parallel_is_initialized": "wf_mesh.parallel_state",
}
_SUBMODULES = {"parallel_state"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"wf_mesh.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'wf_mesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from wf_mesh import parallel_state  # noqa: F401
