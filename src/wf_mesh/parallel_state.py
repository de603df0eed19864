"""Megatron-LM / MAGI-1 ``parallel_state``, every group read from the one :class:`~wf_mesh.mesh.ParallelMesh`.

A drop-in for ``from megatron.core import parallel_state as mpu`` (its dense subset: tensor, context, pipeline
and data parallelism) and for MAGI-1's short names::

    from wf_mesh import parallel_state as mpu
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)  # Megatron keywords
    mpu.initialize_model_parallel(2, 1, 2)                                                  # MAGI-1: tp, pp, cp
    mpu.get_tensor_model_parallel_group(), mpu.get_cp_world_size(), mpu.get_dp_group(with_context_parallel=True)

Groups. Every group is an axis of the mesh (``tp``, ``cp``, ``pp``, ``dp``, ``dp_cp``, ``tp_cp``, ``tp_pp`` =
Megatron's model-parallel group, ``tp_dp``, ``tp_cp_dp``), except Megatron's embedding groups (first and last
pipeline stage, or what ``get_embedding_ranks`` returns) and position-embedding groups (first stage): those
are created by :func:`initialize_model_parallel` with ``new_group`` (on every rank, up front) unless they are
exactly the pipeline group (pp <= 2), and destroyed with the mesh.

Rank order. wf_mesh's and MAGI-1's default ``order`` is ``"tp-cp-pp-dp"``; Megatron's is ``"tp-cp-ep-dp-pp"``
(pipeline slowest). The default here is wf_mesh's: pass ``order="tp-cp-ep-dp-pp"`` to get Megatron's
layout. An ``ep`` in the order is dropped (expert parallelism must be 1).

Arguments. :func:`initialize_model_parallel` takes MAGI-1's positional arguments ``(tp_size, pp_size, cp_size,
nccl_communicator_config_path, distributed_timeout_minutes, order)`` and Megatron's keywords. Megatron's third
positional argument is ``virtual_pipeline_model_parallel_size``, not cp: pass Megatron arguments after the
second by keyword. Passing both spellings of one degree (``tp_size`` and ``tensor_model_parallel_size``) is a
TypeError. Degrees are judged by :class:`~wf_mesh.topology.ParallelDims` during a collective agreement, so a
bad or differing value on one rank raises the same error on every rank.

Not supported (NotImplementedError naming each argument, before any collective): expert parallelism
(``expert_model_parallel_size > 1``, an ``expert_tensor_parallel_size`` other than the tensor-parallel size;
there are no expert getters), hierarchical and hybrid context parallelism, SHARP, more than one
distributed-optimizer instance, a separate all-gather group, high-priority NCCL streams, a pipeline backend
other than the default group's (UCC), and older Megatron's encoder pipeline (``encoder_*``,
``pipeline_model_parallel_split_rank``).

Megatron semantics kept: group getters take ``check_initialized`` (``False``: None instead of an error when
nothing is initialized) and raise :class:`~wf_mesh.legacy.errors.LegacyNotInitializedError` (a
NotInitializedError, a RuntimeError and an AssertionError) before initialization;
``set_{tensor,pipeline}_model_parallel_{world_size,rank}`` override the getters (and the first/last/next/prev
pipeline ranks computed from them) until reset with None or until :func:`destroy_model_parallel`; next/prev pipeline ranks wrap around (the pipeline is a ring);
``is_pipeline_first_stage(ignore_virtual=False)`` judges the virtual stage ``vp_stage`` (or, when it is None,
the virtual rank set with :func:`set_virtual_pipeline_model_parallel_rank`, as older Megatron did).
The overrides apply to the MAGI-1 short names too (``get_tp_world_size`` is ``get_tensor_model_parallel_world_size``).
Differences: when torch.distributed is not initialized at all, world-size getters return 1 and rank getters
0 (a single process is a world of one; Megatron and MAGI-1 return 0 for some sizes); the Gloo getters create
their groups on the first call (collective over the world: every rank must make it, see
:func:`get_dp_group_gloo`), not at initialization; on a rank outside every embedding group,
``get_embedding_group()`` raises :class:`~wf_mesh.legacy.errors.LegacyStateError` (also an AssertionError)
naming the embedding ranks of its pipeline; and the embedding groups exist only when the mesh was built by
:func:`initialize_model_parallel` (not by ``wf_mesh.init_parallel``).

Module globals. Megatron's module globals that callers and Megatron's own tests read
(``parallel_state._TENSOR_MODEL_PARALLEL_GROUP``, ``_DATA_PARALLEL_GLOBAL_RANKS``, ... :data:`MEGATRON_GLOBALS`)
are computed on every read from the live mesh and state (PEP 562 module ``__getattr__``): None when model
parallel is not initialized, as in Megatron after ``destroy_model_parallel``. The Gloo globals are None until
the Gloo groups were requested. They are read-only: assigning one shadows it for good.

``cp_size_t`` (the temporal share of the CP degree) is what the last ``find_split`` planned; it is absent (an
AttributeError) until then and again once the mesh is destroyed; position-embedding code reads it with
``hasattr``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, overload

import torch.distributed as dist

from wf_mesh.legacy import context_parallel as _cp
from wf_mesh.legacy import model_parallel as _mp
from wf_mesh.legacy.errors import LegacyNotInitializedError, LegacyStateError
from wf_mesh.legacy.model_parallel import (
    DEFAULT_ORDER,
    MEGATRON_ORDER,
    current_mesh,
    default_embedding_ranks,
    default_position_embedding_ranks,
    destroy_model_parallel,
    initialize_model_parallel,
    load_nccl_communicator_config,
)
from wf_mesh.mesh import ParallelMesh, parallel_mesh_or_none
from wf_mesh.topology import as_int

__all__ = [
    # lifecycle
    "DEFAULT_ORDER",
    "MEGATRON_GLOBALS",
    "MEGATRON_ORDER",
    "initialize_model_parallel",
    "destroy_model_parallel",
    "model_parallel_is_initialized",
    "is_initialized",
    "load_nccl_communicator_config",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    # tensor parallel
    "get_tp_group",
    "get_tp_world_size",
    "get_tp_rank",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_ranks",
    "get_tensor_model_parallel_last_rank",
    "set_tensor_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_context_parallel_rank",
    # context parallel
    "get_cp_group",
    "get_cp_world_size",
    "get_cp_rank",
    "get_context_parallel_group",
    "get_context_parallel_world_size",
    "get_context_parallel_rank",
    "get_context_parallel_global_ranks",
    # pipeline parallel
    "get_pp_group",
    "get_pp_world_size",
    "get_pp_rank",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "set_pipeline_model_parallel_world_size",
    "set_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_virtual_pipeline_model_parallel_rank",
    "set_virtual_pipeline_model_parallel_rank",
    "get_virtual_pipeline_model_parallel_world_size",
    "set_virtual_pipeline_model_parallel_world_size",
    # embedding groups
    "get_embedding_group",
    "get_position_embedding_group",
    "is_rank_in_embedding_group",
    "is_rank_in_position_embedding_group",
    # data parallel
    "get_dp_group",
    "get_dp_group_gloo",
    "get_dp_world_size",
    "get_dp_rank",
    "get_data_parallel_group",
    "get_data_parallel_group_gloo",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "get_data_parallel_src_rank",
    "has_separate_all_gather_group",
    # combined groups
    "get_model_parallel_group",
    "get_model_parallel_src_rank",
    "get_tensor_and_data_parallel_group",
    "get_amax_reduction_group",
]


def model_parallel_is_initialized() -> bool:
    """True once :func:`initialize_model_parallel` (or ``init_parallel``) has built the mesh."""
    return parallel_mesh_or_none() is not None


is_initialized = model_parallel_is_initialized


# ---- helpers ----------------------------------------------------------------------------------------
@overload
def _mesh(check_initialized: Literal[True]) -> ParallelMesh: ...
@overload
def _mesh(check_initialized: bool) -> ParallelMesh | None: ...
def _mesh(check_initialized: bool) -> ParallelMesh | None:
    if not check_initialized:
        return parallel_mesh_or_none()
    return current_mesh()


def _group(axis: str, check_initialized: bool = True) -> dist.ProcessGroup | None:
    mesh = _mesh(check_initialized)
    return None if mesh is None else mesh.group(axis)


@overload
def _ranks(axis: str, check_initialized: Literal[True] = True) -> list[int]: ...
@overload
def _ranks(axis: str, check_initialized: bool) -> list[int] | None: ...
def _ranks(axis: str, check_initialized: bool = True) -> list[int] | None:
    mesh = _mesh(check_initialized)
    return None if mesh is None else mesh.ranks(axis)


def _size(axis: str, override: int | None = None) -> int:
    if override is not None:
        return override
    if not dist.is_initialized():
        return 1
    return _mesh(True).size(axis)


def _rank(axis: str, override: int | None = None) -> int:
    if override is not None:
        return override
    if not dist.is_initialized():
        return 0
    return _mesh(True).rank(axis)


def _override(name: str, value: int | None, minimum: int) -> int | None:
    return None if value is None else as_int(name, value, minimum=minimum)


def _tp(with_context_parallel: bool) -> str:
    return "tp_cp" if with_context_parallel else "tp"


def _dp(with_context_parallel: bool, partial_data_parallel: bool = False) -> str:
    if partial_data_parallel and not with_context_parallel:
        raise ValueError(
            "partial_data_parallel=True needs with_context_parallel=True (the distributed optimizer's partial "
            "data-parallel group includes cp)"
        )
    return "dp_cp" if with_context_parallel else "dp"


# ---- tensor parallel --------------------------------------------------------------------------------
def get_tp_group(check_initialized: bool = True, with_context_parallel: bool = False) -> dist.ProcessGroup | None:
    """This rank's tensor-parallel group (tp x cp with ``with_context_parallel=True``)."""
    return _group(_tp(with_context_parallel), check_initialized)


def get_tp_world_size(with_context_parallel: bool = False) -> int:
    """Size of the tp (or tp x cp) group; the :func:`set_tensor_model_parallel_world_size` value if set."""
    return _size(_tp(with_context_parallel), None if with_context_parallel else _mp.state.tp_world_size)


def get_tp_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its tp (or tp x cp) group; the :func:`set_tensor_model_parallel_rank` value if set."""
    return _rank(_tp(with_context_parallel), None if with_context_parallel else _mp.state.tp_rank)


get_tensor_model_parallel_group = get_tp_group
get_tensor_model_parallel_world_size = get_tp_world_size
get_tensor_model_parallel_rank = get_tp_rank


def get_tensor_model_parallel_ranks(with_context_parallel: bool = False) -> list[int]:
    """Global ranks of this rank's tp (or tp x cp) group, in group order."""
    return _ranks(_tp(with_context_parallel))


def get_tensor_model_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of this rank's tp (or tp x cp) group."""
    return get_tensor_model_parallel_ranks(with_context_parallel)[0]


def get_tensor_model_parallel_last_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the last member of this rank's tp (or tp x cp) group."""
    return get_tensor_model_parallel_ranks(with_context_parallel)[-1]


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Make the tp world-size getters return ``world_size`` (None: the group's again) until destroy."""
    _mp.state.tp_world_size = _override("world_size", world_size, minimum=1)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Make the tp rank getters return ``rank`` (None: the group's again) until destroy."""
    _mp.state.tp_rank = _override("rank", rank, minimum=0)


def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's tp x cp group."""
    return _group("tp_cp", check_initialized)


def get_tensor_and_context_parallel_world_size() -> int:
    """Size of the tp x cp group."""
    return _size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    """This rank's index in its tp x cp group."""
    return _rank("tp_cp")


# ---- context parallel -------------------------------------------------------------------------------
def get_cp_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's context-parallel group."""
    return _group("cp", check_initialized)


def get_cp_world_size() -> int:
    """Size of the cp group."""
    return _size("cp")


def get_cp_rank() -> int:
    """This rank's index in its cp group."""
    return _rank("cp")


get_context_parallel_group = get_cp_group
get_context_parallel_world_size = get_cp_world_size
get_context_parallel_rank = get_cp_rank


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    """Global ranks of this rank's cp group, in group order."""
    return _ranks("cp", check_initialized)


# ---- pipeline parallel ------------------------------------------------------------------------------
def get_pp_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """This rank's pipeline-parallel group."""
    return _group("pp", check_initialized)


def get_pp_world_size() -> int:
    """Number of pipeline stages; the :func:`set_pipeline_model_parallel_world_size` value if set."""
    return _size("pp", _mp.state.pp_world_size)


def get_pp_rank() -> int:
    """This rank's pipeline stage; the :func:`set_pipeline_model_parallel_rank` value if set."""
    return _rank("pp", _mp.state.pp_rank)


get_pipeline_model_parallel_group = get_pp_group
get_pipeline_model_parallel_world_size = get_pp_world_size
get_pipeline_model_parallel_rank = get_pp_rank


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Make the pp world-size getters return ``world_size`` (None: the group's again) until destroy."""
    _mp.state.pp_world_size = _override("world_size", world_size, minimum=1)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Make the pp rank getters return ``rank`` (None: the group's again) until destroy."""
    _mp.state.pp_rank = _override("rank", rank, minimum=0)


def _pipeline_rank(stage: int) -> int:
    """Global rank of ``stage`` of this rank's pipeline (stages counted modulo the pp world size)."""
    ranks, size = _mesh(True).ranks("pp"), get_pp_world_size()
    stage %= size
    if stage >= len(ranks):
        raise IndexError(
            f"pipeline stage {stage} does not exist: this pipeline is {ranks} (pp world size overridden to {size})"
        )
    return ranks[stage]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of stage 0 of this rank's pipeline."""
    return _pipeline_rank(0)


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of this rank's pipeline."""
    return _pipeline_rank(get_pp_world_size() - 1)


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage; the last stage's next is stage 0 (a ring)."""
    return _pipeline_rank(get_pp_rank() + 1)


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage; stage 0's previous is the last stage (a ring)."""
    return _pipeline_rank(get_pp_rank() - 1)


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    """The current virtual pipeline stage of this rank (None: virtual pipelining off)."""
    return _mp.state.vpp_rank


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Set the current virtual pipeline stage (judged by ``is_pipeline_*_stage`` when no ``vp_stage`` is given)."""
    _mp.state.vpp_rank = _override("rank", rank, minimum=0)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Virtual stages per pipeline rank (None: virtual pipelining off)."""
    return _mp.state.vpp_world_size


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Set the number of virtual stages per pipeline rank (None: virtual pipelining off)."""
    _mp.state.vpp_world_size = _override("world_size", world_size, minimum=1)


def _virtual_stage(vp_stage: int | None) -> int | None:
    """The virtual stage to judge: ``vp_stage``, else the set virtual rank; None when virtual pipelining is off."""
    if _mp.state.vpp_world_size is None:
        return None
    stage = _mp.state.vpp_rank if vp_stage is None else vp_stage
    if stage is None:
        raise ValueError(
            f"vp_stage must be given: virtual pipelining is on (virtual world size {_mp.state.vpp_world_size}) and "
            "no virtual rank is set"
        )
    return stage


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on pipeline stage 0; with ``ignore_virtual=False`` and virtual pipelining, only in virtual stage 0."""
    if not ignore_virtual and _virtual_stage(vp_stage) not in (None, 0):
        return False
    return get_pp_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank is on the last pipeline stage.

    Returns:
        True on the last stage; with ``ignore_virtual=False`` and virtual pipelining, only in the last
        virtual stage.
    """
    if not ignore_virtual:
        stage = _virtual_stage(vp_stage)
        vpp_world_size = _mp.state.vpp_world_size  # set whenever there is a virtual stage
        if stage is not None and vpp_world_size is not None and stage != vpp_world_size - 1:
            return False
    return get_pp_rank() == get_pp_world_size() - 1


# ---- embedding groups -------------------------------------------------------------------------------
def _embedding_group(kind: str, check_initialized: bool) -> dist.ProcessGroup | None:
    mesh = _mesh(check_initialized)
    if mesh is None:
        return None
    group = getattr(_mp.state, f"{kind}_group")
    if group is not None or not check_initialized:
        return group
    name = kind.replace("_", "-")
    if not _mp.state.built:
        raise LegacyNotInitializedError(
            f"no {name} group: it is built by initialize_model_parallel, and this mesh was built by init_parallel"
        )
    raise LegacyStateError(
        f"rank {mesh.global_rank} is in no {name} group: its pipeline {mesh.ranks('pp')} has {name} ranks "
        f"{getattr(_mp.state, f'{kind}_ranks')}"
    )


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The group of the stages holding the word embeddings (default: first and last) of this rank's pipeline.

    Returns:
        The group (None with ``check_initialized=False`` on a rank outside it).

    Raises:
        LegacyStateError: this rank is outside it.
    """
    return _embedding_group("embedding", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The group of the stages holding the position embeddings (default: the first) of this rank's pipeline.

    Returns:
        The group (None with ``check_initialized=False`` on a rank outside it).

    Raises:
        LegacyStateError: this rank is outside it.
    """
    return _embedding_group("position_embedding", check_initialized)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """Whether this rank holds embeddings.

    Returns:
        True on an embedding rank; with ``ignore_virtual=False``, the first (last) embedding rank only in its
        first (last) virtual stage.
    """
    ranks = _mp.state.embedding_ranks
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """True if this rank holds position embeddings."""
    ranks = _mp.state.position_embedding_ranks
    return ranks is not None and (dist.get_rank() if dist.is_initialized() else 0) in ranks


# ---- data parallel ----------------------------------------------------------------------------------
def get_dp_group(
    with_context_parallel: bool = False,
    partial_data_parallel: bool = False,
    independent_all_gather: bool = False,
    *,
    check_initialized: bool = True,
) -> dist.ProcessGroup | None:
    """This rank's dp group (dp x cp, the FSDP axis, with ``with_context_parallel=True``).

    ``partial_data_parallel=True`` (needs cp) is the same dp x cp group: there is one optimizer instance.

    Returns:
        The group (None with ``check_initialized=False`` when nothing is initialized).

    Raises:
        LegacyStateError: ``independent_all_gather=True``: no separate all-gather group is built.
        ValueError: ``partial_data_parallel=True`` without ``with_context_parallel=True``.
    """
    axis = _dp(with_context_parallel, partial_data_parallel)
    if with_context_parallel and independent_all_gather:
        raise LegacyStateError(
            "independent_all_gather=True: wf_mesh builds no separate all-gather group "
            "(create_all_gather_group is not supported); use get_data_parallel_group(with_context_parallel=True)"
        )
    return _group(axis, check_initialized)


def get_dp_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False, *, check_initialized: bool = True
) -> dist.ProcessGroup | None:
    """A Gloo group over the same ranks as :func:`get_dp_group` (dp x cp with ``with_context_parallel=True``).

    Created on the first call (both kinds at once) and destroyed with the mesh. That first call is collective
    over the whole world: every rank must make it (as in Megatron, where every rank builds them at init).

    Returns:
        The Gloo group; None with ``check_initialized=False`` when nothing is initialized.

    Raises:
        LegacyStateError: ``create_gloo_process_groups=False`` was passed to initialize_model_parallel.
        LegacyNotInitializedError: model parallel is not initialized.
    """
    _dp(with_context_parallel, partial_data_parallel)  # the arguments' own check
    if _mesh(check_initialized) is None:
        return None
    return _mp.data_parallel_gloo_group(with_context_parallel)


def get_dp_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Size of the dp (or dp x cp) group."""
    return _size(_dp(with_context_parallel, partial_data_parallel))


def get_dp_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """This rank's index in its dp (or dp x cp) group."""
    return _rank(_dp(with_context_parallel, partial_data_parallel))


get_data_parallel_group = get_dp_group
get_data_parallel_group_gloo = get_dp_group_gloo
get_data_parallel_world_size = get_dp_world_size
get_data_parallel_rank = get_dp_rank


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of this rank's dp (or dp x cp) group."""
    return _ranks(_dp(with_context_parallel))[0]


def has_separate_all_gather_group() -> bool:
    """Always False: wf_mesh builds no separate all-gather group (Megatron's ``create_all_gather_group``)."""
    return False


# ---- combined groups --------------------------------------------------------------------------------
def get_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Megatron's model-parallel group: tp x pp (it excludes cp)."""
    return _group("tp_pp", check_initialized)


def get_model_parallel_src_rank() -> int:
    """Global rank of the first member of this rank's model-parallel (tp x pp) group."""
    return _ranks("tp_pp")[0]


def get_tensor_and_data_parallel_group(
    check_initialized: bool = True, with_context_parallel: bool = False
) -> dist.ProcessGroup | None:
    """This rank's tp x dp group (tp x cp x dp with ``with_context_parallel=True``)."""
    return _group("tp_cp_dp" if with_context_parallel else "tp_dp", check_initialized)


def get_amax_reduction_group(
    with_context_parallel: bool = False, tp_only_amax_red: bool = False, *, check_initialized: bool = True
) -> dist.ProcessGroup | None:
    """The FP8 amax-reduction group, as Megatron picks it.

    Returns:
        tp x dp (tp x cp x dp with ``with_context_parallel``); with ``tp_only_amax_red=True``, tp (tp x cp).
    """
    if tp_only_amax_red:
        return get_tp_group(check_initialized, with_context_parallel)
    return get_tensor_and_data_parallel_group(check_initialized, with_context_parallel)


# ---- Megatron's module globals (PEP 562) ----------------------------------------------------------------
def _live_group(axis: str) -> Callable[[], dist.ProcessGroup | None]:
    return lambda: _group(axis, check_initialized=False)


def _live_ranks(axis: str) -> Callable[[], list[int] | None]:
    return lambda: _ranks(axis, check_initialized=False)


def _live_gloo(axis: str) -> Callable[[], dist.ProcessGroup | None]:
    def read() -> dist.ProcessGroup | None:
        groups = _mp.state.gloo_groups
        return None if groups is None or parallel_mesh_or_none() is None else groups[axis]

    return read


def _live_state(field: str) -> Callable[[], object]:
    return lambda: getattr(_mp.state, field) if parallel_mesh_or_none() is not None else None


MEGATRON_GLOBALS: dict[str, Callable[[], object]] = {
    "_MODEL_PARALLEL_GROUP": _live_group("tp_pp"),
    "_MODEL_PARALLEL_GLOBAL_RANKS": _live_ranks("tp_pp"),
    "_TENSOR_MODEL_PARALLEL_GROUP": _live_group("tp"),
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": _live_ranks("tp"),
    "_PIPELINE_MODEL_PARALLEL_GROUP": _live_group("pp"),
    "_PIPELINE_GLOBAL_RANKS": _live_ranks("pp"),
    "_DATA_PARALLEL_GROUP": _live_group("dp"),
    "_DATA_PARALLEL_GLOBAL_RANKS": _live_ranks("dp"),
    "_DATA_PARALLEL_GROUP_GLOO": _live_gloo("dp"),
    "_DATA_PARALLEL_GROUP_WITH_CP": _live_group("dp_cp"),
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": _live_ranks("dp_cp"),
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": _live_gloo("dp_cp"),
    "_CONTEXT_PARALLEL_GROUP": _live_group("cp"),
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": _live_ranks("cp"),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": _live_group("tp_cp"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP": _live_group("tp_dp"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": _live_group("tp_cp_dp"),
    "_EMBEDDING_GROUP": _live_state("embedding_group"),
    "_EMBEDDING_GLOBAL_RANKS": _live_state("embedding_ranks"),
    "_POSITION_EMBEDDING_GROUP": _live_state("position_embedding_group"),
    "_POSITION_EMBEDDING_GLOBAL_RANKS": _live_state("position_embedding_ranks"),
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": _live_state("tp_world_size"),
    "_MPU_TENSOR_MODEL_PARALLEL_RANK": _live_state("tp_rank"),
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": _live_state("pp_world_size"),
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK": _live_state("pp_rank"),
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": _live_state("vpp_rank"),
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": _live_state("vpp_world_size"),
}
"""Megatron's module global -> how its live value is read (a group, a rank list, an override), None when model
parallel is not initialized."""


def __getattr__(name: str) -> object:
    """Megatron's module globals (:data:`MEGATRON_GLOBALS`) and ``cp_size_t``, read live."""
    if name in MEGATRON_GLOBALS:
        return MEGATRON_GLOBALS[name]()
    if name == "cp_size_t" and _cp.cp_size_t() is not None:
        return _cp.cp_size_t()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *MEGATRON_GLOBALS])
