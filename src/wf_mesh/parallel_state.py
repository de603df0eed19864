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
nothing is initialized) and raise :class:`~wf_mesh.errors.NotInitializedError` (an AssertionError and a
RuntimeError) before initialization; ``set_{tensor,pipeline}_model_parallel_{world_size,rank}`` override the
getters (and the first/last/next/prev pipeline ranks computed from them) until reset with None or until
:func:`destroy_model_parallel`; next/prev pipeline ranks wrap around (the pipeline is a ring);
``is_pipeline_first_stage(ignore_virtual=False)`` judges the virtual stage ``vp_stage`` (or, when it is None,
the virtual rank set with :func:`set_virtual_pipeline_model_parallel_rank`, as older Megatron did).
The overrides apply to the MAGI-1 short names too (``get_tp_world_size`` is ``get_tensor_model_parallel_world_size``).
Differences: when torch.distributed is not initialized at all, world-size getters return 1 and rank getters
0 (a single process is a world of one; Megatron and MAGI-1 return 0 for some sizes); the Gloo getters return
the data-parallel group itself when the backend already is Gloo; on a rank outside every embedding group,
``get_embedding_group()`` raises :class:`~wf_mesh.errors.StateError` (also an AssertionError) naming the
embedding ranks of its pipeline; and the embedding groups exist only when the mesh was built by
:func:`initialize_model_parallel` (not by ``wf_mesh.init_parallel``).

``cp_size_t`` (the temporal share of the CP degree) is set on this module by ``find_split`` and removed when the
mesh is destroyed; position-embedding code reads it with ``hasattr``.
"""

from __future__ import annotations

import dataclasses
import datetime
import numbers
import warnings
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist

from wf_mesh import _compat, agreement
from wf_mesh.errors import DegreeError, NotInitializedError, StateError
from wf_mesh.mesh import (
    ParallelMesh,
    get_parallel_mesh,
    init_parallel,
    parallel_mesh_or_none,
    register_destroy_hook,
    run_destroy_hooks,
)
from wf_mesh.topology import ParallelDims, as_int

__all__ = [
    # lifecycle
    "DEFAULT_ORDER",
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

DEFAULT_ORDER = "tp-cp-pp-dp"
"""wf_mesh's and MAGI-1's default rank order (tp fastest, dp slowest)."""

MEGATRON_ORDER = "tp-cp-ep-dp-pp"
"""Megatron-LM's default rank order (pipeline slowest); pass it as ``order=`` to get Megatron's layout."""

# Keys of the NCCL communicator YAML (Megatron's names) -> wf_mesh axes. "mp" is Megatron's model-parallel group.
COMMUNICATOR_CONFIG_AXES = {
    "dp": "dp",
    "dp_cp": "dp_cp",
    "cp": "cp",
    "mp": "tp_pp",
    "tp": "tp",
    "tp_cp": "tp_cp",
    "pp": "pp",
    "tp_cp_dp": "tp_cp_dp",
    "tp_dp": "tp_dp",
}


@dataclasses.dataclass
class _State:
    """What this module keeps besides the mesh; a fresh one whenever the mesh is destroyed."""

    tp_world_size: int | None = None  # set_tensor_model_parallel_world_size
    tp_rank: int | None = None
    pp_world_size: int | None = None
    pp_rank: int | None = None
    vpp_world_size: int | None = None
    vpp_rank: int | None = None
    gloo: bool = True  # initialize_model_parallel(create_gloo_process_groups=)
    built: bool = False  # initialize_model_parallel built the embedding groups of the current mesh
    embedding_ranks: list[int] | None = None  # of this rank's pipeline, member or not
    embedding_group: dist.ProcessGroup | None = None  # None where this rank is not a member
    position_embedding_ranks: list[int] | None = None
    position_embedding_group: dist.ProcessGroup | None = None
    created: list[dist.ProcessGroup] = dataclasses.field(default_factory=list)  # new_group'ed, this rank a member


_state = _State()


# ---- lifecycle --------------------------------------------------------------------------------------
def load_nccl_communicator_config(path: str | Path) -> dict[str, dict[str, int]]:
    """Read Megatron's per-group NCCL communicator YAML and return it keyed by wf_mesh axis name.

    The file maps group names (``dp``, ``dp_cp``, ``cp``, ``mp``, ``tp``, ``tp_cp``, ``pp``, ``tp_cp_dp``,
    ``tp_dp``) to ``{min_ctas, max_ctas, cga_cluster_size}`` integers. Needs PyYAML (``pip install pyyaml``).
    """
    try:
        import yaml
    except ImportError as e:
        raise ImportError(
            f"nccl_communicator_config_path={str(path)!r} needs PyYAML: pip install pyyaml (or wf-mesh[yaml])"
        ) from e
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"nccl_communicator_config_path: no such file {str(path)!r}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"nccl_communicator_config_path {str(path)!r} is not valid YAML: {e}") from e
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"{str(path)!r} must map group names to options, got {type(raw).__name__}")
    config: dict[str, dict[str, int]] = {}
    for group, options in raw.items():
        if group not in COMMUNICATOR_CONFIG_AXES:
            raise ValueError(f"{str(path)!r}: unknown group {group!r}; groups are {list(COMMUNICATOR_CONFIG_AXES)}")
        if not isinstance(options, dict) or not all(
            k in _compat.NCCL_OPTION_KEYS and isinstance(v, int) and not isinstance(v, bool)
            for k, v in options.items()
        ):
            raise ValueError(
                f"{str(path)!r}: group {group!r} must map {list(_compat.NCCL_OPTION_KEYS)} to ints, got {options!r}"
            )
        config[COMMUNICATOR_CONFIG_AXES[group]] = dict(options)
    return config


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Megatron's default embedding ranks of one pipeline: its first and last stage (the one rank when pp=1)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Megatron's default position-embedding ranks of one pipeline: its first stage."""
    return [pp_ranks[0]]


def initialize_model_parallel(
    tp_size: int | None = None,
    pp_size: int | None = None,
    cp_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: float = 30,
    order: str = DEFAULT_ORDER,
    *,
    tensor_model_parallel_size: int | None = None,
    pipeline_model_parallel_size: int | None = None,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int | None = None,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    get_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int]], list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Sequence[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
    encoder_tensor_model_parallel_size: int | None = 0,
    encoder_pipeline_model_parallel_size: int | None = 0,
    pipeline_model_parallel_split_rank: int | None = None,
) -> None:
    """Build the process-wide mesh and Megatron's embedding groups; dp = world_size // (tp * pp * cp).

    Collective: every rank calls it with the same arguments. Positional arguments are MAGI-1's; the keywords
    are Megatron's (see the module docstring for what is not supported). A degree left out (None) is 1.

    Args:
        tp_size / tensor_model_parallel_size: tensor-parallel degree (give one spelling).
        pp_size / pipeline_model_parallel_size: pipeline-parallel degree.
        cp_size / context_parallel_size: context-parallel degree.
        nccl_communicator_config_path: Megatron's per-group NCCL YAML (:func:`load_nccl_communicator_config`);
            ignored, with a warning, when the backend is not NCCL.
        distributed_timeout_minutes: timeout of the subgroups' collectives.
        order: rank order, fastest axis first; default :data:`DEFAULT_ORDER` (Megatron's is
            :data:`MEGATRON_ORDER`); an ``ep`` in it is dropped.
        virtual_pipeline_model_parallel_size: virtual stages per pipeline rank (interleaved schedule); needs
            pp > 1. Sets the virtual world size to it and the virtual rank to 0.
        get_embedding_ranks / get_position_embedding_ranks: ``f(pipeline_ranks) -> ranks`` choosing which
            stages of each pipeline hold the (position) embeddings; default :func:`default_embedding_ranks` /
            :func:`default_position_embedding_ranks`. Must return distinct ranks of that pipeline.
        create_gloo_process_groups: False makes the Gloo getters raise (as in Megatron).
        expert_model_parallel_size: must be 1; expert_tensor_parallel_size: None or the tensor-parallel size.
        pipeline_model_parallel_comm_backend: None or the default group's backend.

    Raises (every rank alike where it says so):
        TypeError: both spellings of a degree, a callable or flag of the wrong type (this rank, at once);
            a degree that is not an int (every rank).
        NotImplementedError: an unsupported feature (this rank, at once; see the module docstring).
        StateError (an AssertionError and a RuntimeError): torch.distributed is not initialized (this rank),
            or model parallel is already initialized (every rank).
        DegreeError (a ValueError and a RuntimeError): the degrees do not fit the world size or each other,
            or virtual pipelining without pp > 1 (every rank, naming the factors and the rank(s)).
        DisagreementError: ranks passed different degrees, order, timeout, virtual size or embedding ranks.
        ValueError: an embedding-rank function returned ranks outside its pipeline (every rank).
    """
    tp = _one_spelling("tp_size", tp_size, "tensor_model_parallel_size", tensor_model_parallel_size)
    pp = _one_spelling("pp_size", pp_size, "pipeline_model_parallel_size", pipeline_model_parallel_size)
    cp = _one_spelling("cp_size", cp_size, "context_parallel_size", context_parallel_size)
    for name, fn in (("get_embedding_ranks", get_embedding_ranks),
                     ("get_position_embedding_ranks", get_position_embedding_ranks)):  # fmt: skip
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable f(pipeline_ranks) -> ranks or None, got {fn!r}")
    if not isinstance(create_gloo_process_groups, bool):
        raise TypeError(f"create_gloo_process_groups must be a bool, got {create_gloo_process_groups!r}")
    timeout = _timeout(distributed_timeout_minutes)
    _refuse_unsupported(
        _or_one(tp),
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        hybrid_context_parallel=hybrid_context_parallel,
        use_sharp=use_sharp,
        sharp_enabled_group=sharp_enabled_group,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        create_all_gather_group=create_all_gather_group,
        high_priority_stream_groups=high_priority_stream_groups,
        encoder_tensor_model_parallel_size=encoder_tensor_model_parallel_size,
        encoder_pipeline_model_parallel_size=encoder_pipeline_model_parallel_size,
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
    )
    if isinstance(order, str):  # anything else: ParallelDims names the type
        order = "-".join(axis for axis in order.split("-") if axis != "ep")
    if not dist.is_initialized():
        raise StateError(
            "initialize_model_parallel needs torch.distributed: call torch.distributed.init_process_group(...) "
            "or wf_mesh.dist_init(config) first"
        )
    if pipeline_model_parallel_comm_backend not in (None, dist.get_backend()):
        raise NotImplementedError(
            f"initialize_model_parallel: pipeline_model_parallel_comm_backend={pipeline_model_parallel_comm_backend!r}"
            f" is not supported: pipeline groups use the default group's backend {dist.get_backend()!r}"
        )
    nccl_config = None
    if nccl_communicator_config_path is not None:
        nccl_config = load_nccl_communicator_config(nccl_communicator_config_path)
        if dist.get_backend() != "nccl":
            warnings.warn(
                f"nccl_communicator_config_path={nccl_communicator_config_path!r} ignored: "
                f"backend is {dist.get_backend()!r}, not 'nccl'",
                stacklevel=2,
            )
            nccl_config = None

    plan = _agree_on_plan(
        (tp, cp, pp),
        order,
        virtual_pipeline_model_parallel_size,
        {"embedding": get_embedding_ranks, "position_embedding": get_position_embedding_ranks},
        create_gloo_process_groups,
    )
    mesh = init_parallel(plan["dims"], timeout=timeout, nccl_config=nccl_config)
    try:
        _build_embedding_groups(mesh, plan["embedding_ranks"])
    except BaseException:
        destroy_model_parallel()
        raise
    _state.gloo = create_gloo_process_groups
    if plan["vpp"] is not None:
        _state.vpp_world_size, _state.vpp_rank = plan["vpp"], 0


def _one_spelling(short: str, short_value: int | None, long: str, long_value: int | None) -> int | None:
    if short_value is not None and long_value is not None:
        raise TypeError(
            f"initialize_model_parallel got both {short}={short_value!r} and {long}={long_value!r}: they are the "
            "same degree, pass one"
        )
    return long_value if short_value is None else short_value


def _or_one(value: int | None) -> int:
    return 1 if value is None else value


def _timeout(minutes: float) -> datetime.timedelta:
    if isinstance(minutes, bool) or not isinstance(minutes, numbers.Real):
        raise TypeError(f"distributed_timeout_minutes must be a number, got {type(minutes).__name__} {minutes!r}")
    if not minutes > 0:
        raise ValueError(f"distributed_timeout_minutes must be > 0, got {minutes!r}")
    return datetime.timedelta(minutes=float(minutes))


def _refuse_unsupported(
    tp: int,
    *,
    expert_model_parallel_size: object,
    expert_tensor_parallel_size: object,
    hierarchical_context_parallel_sizes: object,
    hybrid_context_parallel: object,
    use_sharp: object,
    sharp_enabled_group: object,
    num_distributed_optimizer_instances: object,
    create_all_gather_group: object,
    high_priority_stream_groups: object,
    encoder_tensor_model_parallel_size: object,
    encoder_pipeline_model_parallel_size: object,
    pipeline_model_parallel_split_rank: object,
) -> None:
    """NotImplementedError naming every feature of Megatron's signature that is on and that wf_mesh lacks."""
    ep = expert_model_parallel_size
    checks = [  # (argument, its value, what it asks for, whether it is on)
        ("expert_model_parallel_size", ep, "expert parallelism", ep != 1 or isinstance(ep, bool)),
        ("expert_tensor_parallel_size", expert_tensor_parallel_size,
         f"a separate expert tensor-parallel layout; tensor_model_parallel_size={tp}",
         expert_tensor_parallel_size not in (None, tp)),
        ("hierarchical_context_parallel_sizes", hierarchical_context_parallel_sizes, "hierarchical cp",
         bool(hierarchical_context_parallel_sizes)),
        ("hybrid_context_parallel", hybrid_context_parallel, "hybrid cp", bool(hybrid_context_parallel)),
        ("use_sharp", use_sharp, "SHARP", bool(use_sharp)),
        ("sharp_enabled_group", sharp_enabled_group, "SHARP", sharp_enabled_group is not None),
        ("num_distributed_optimizer_instances", num_distributed_optimizer_instances, "partial data parallel",
         num_distributed_optimizer_instances != 1),
        ("create_all_gather_group", create_all_gather_group, "a second dp x cp communicator",
         bool(create_all_gather_group)),
        ("high_priority_stream_groups", high_priority_stream_groups, "high-priority NCCL streams",
         bool(high_priority_stream_groups)),
        ("encoder_tensor_model_parallel_size", encoder_tensor_model_parallel_size, "encoder pipeline",
         encoder_tensor_model_parallel_size not in (0, None)),
        ("encoder_pipeline_model_parallel_size", encoder_pipeline_model_parallel_size, "encoder pipeline",
         encoder_pipeline_model_parallel_size not in (0, None)),
        ("pipeline_model_parallel_split_rank", pipeline_model_parallel_split_rank, "encoder pipeline",
         pipeline_model_parallel_split_rank is not None),
    ]  # fmt: skip
    refused = [f"{name}={value!r} ({what})" for name, value, what, on in checks if on]
    if refused:
        raise NotImplementedError(
            f"initialize_model_parallel: not supported by wf_mesh (dense tp/cp/pp/dp only): {', '.join(refused)}"
        )


def _agree_on_plan(
    degrees: tuple[int | None, int | None, int | None],
    order: str,
    vpp: int | None,
    choosers: dict[str, Callable[[list[int]], list[int]] | None],
    gloo: bool,
) -> dict:
    """Judge the degrees (ParallelDims), the virtual size and the embedding ranks on every rank and agree on
    them (one all-gather): every rank gets the same verdict. Returns the dims, vpp and embedding ranks."""
    tp, cp, pp = (_or_one(d) for d in degrees)
    world_size, plan = dist.get_world_size(), {}
    defaults = {"embedding": default_embedding_ranks, "position_embedding": default_position_embedding_ranks}

    def facts() -> list[int]:
        dims = ParallelDims(tp=tp, cp=cp, pp=pp, order=order).resolve(world_size)
        size = None if vpp is None else as_int("virtual_pipeline_model_parallel_size", vpp, minimum=1)
        if size is not None and dims.pp == 1:
            raise DegreeError(
                f"virtual_pipeline_model_parallel_size={size} needs pipeline_model_parallel_size > 1 (got "
                f"{dims.pp}): the interleaved schedule splits pipeline stages"
            )
        ranks = {
            kind: _embedding_plan(dims, choosers[kind] or defaults[kind], f"get_{kind}_ranks") for kind in defaults
        }
        plan.update(dims=dims, vpp=size, embedding_ranks=ranks)
        return [size or 0, _crc(ranks["embedding"]), _crc(ranks["position_embedding"]), int(gloo)]

    agreed = agreement.agree(dist.group.WORLD, facts, what="initialize_model_parallel", required=True)
    renders = {
        "virtual_pipeline_model_parallel_size": lambda v: v or None,
        "embedding ranks": lambda v: f"crc {v:08x}",
        "position embedding ranks": lambda v: f"crc {v:08x}",
        "create_gloo_process_groups": bool,
    }
    for i, (label, render) in enumerate(renders.items()):
        agreed.require_same(label, lambda row, i=i, render=render: render(row[i]),
                            hint="; every rank must pass the same arguments")  # fmt: skip
    return plan


def _crc(value: object) -> int:
    return zlib.crc32(repr(value).encode())


def _embedding_plan(dims: ParallelDims, choose: Callable[[list[int]], list[int]], name: str) -> list[list[int]]:
    """``choose(pipeline)`` for every pipeline group in order, checked: distinct ranks of that pipeline."""
    plan = []
    for pp_ranks in dims.iter_groups("pp"):
        got = choose(list(pp_ranks))
        ranks = [as_int(f"a rank returned by {name}", r) for r in got]
        if not ranks or len(set(ranks)) != len(ranks) or not set(ranks) <= set(pp_ranks):
            raise ValueError(
                f"{name}({pp_ranks}) returned {got!r}: it must return distinct ranks of that pipeline (at least one)"
            )
        plan.append(ranks)
    return plan


def _build_embedding_groups(mesh: ParallelMesh, plans: dict[str, list[list[int]]]) -> None:
    """Find or create each pipeline's (position-)embedding group; collective, the same order on every rank.

    A group that is exactly its pipeline is the mesh's pp group; any other is created with ``new_group``.
    """
    rank, mine = mesh.global_rank, mesh.ranks("pp")
    for kind, plan in plans.items():
        for pp_ranks, ranks in zip(mesh.dims.iter_groups("pp"), plan):
            group = None
            if ranks == pp_ranks:
                if rank in ranks:
                    group = mesh.group("pp")
            else:
                created = dist.new_group(ranks, timeout=mesh.timeout)  # every rank calls it, member or not
                if rank in ranks:
                    group = created
                    _state.created.append(created)
            if pp_ranks == mine:
                setattr(_state, f"{kind}_ranks", ranks)
                setattr(_state, f"{kind}_group", group)
    _state.built = True


def destroy_model_parallel(destroy_process_groups: bool = True) -> None:
    """Destroy the subgroups wf_mesh created and clear all model-parallel state (overrides included).

    The default process group is left alive: the launcher owns it. Pass ``destroy_process_groups=False``
    only when an external framework has already destroyed the subgroups. Safe to call when nothing is
    initialized.
    """
    mesh = parallel_mesh_or_none()
    if mesh is not None:
        mesh.destroy(destroy_process_groups)
    else:
        run_destroy_hooks(destroy_process_groups)


def _reset_module_state(destroy_process_groups: bool) -> None:
    """Destroy hook: forget ``cp_size_t``, the overrides, the virtual pipeline and the embedding groups."""
    global _state
    globals().pop("cp_size_t", None)
    created, _state = _state.created, _State()
    if destroy_process_groups and dist.is_initialized():
        for group in created:
            dist.destroy_process_group(group)


register_destroy_hook(_reset_module_state)


def model_parallel_is_initialized() -> bool:
    """True once :func:`initialize_model_parallel` (or ``init_parallel``) has built the mesh."""
    return parallel_mesh_or_none() is not None


is_initialized = model_parallel_is_initialized


# ---- helpers ----------------------------------------------------------------------------------------
def _mesh(check_initialized: bool) -> ParallelMesh | None:
    return get_parallel_mesh() if check_initialized else parallel_mesh_or_none()


def _group(axis: str, check_initialized: bool = True) -> dist.ProcessGroup | None:
    mesh = _mesh(check_initialized)
    return None if mesh is None else mesh.group(axis)


def _ranks(axis: str, check_initialized: bool = True) -> list[int] | None:
    mesh = _mesh(check_initialized)
    return None if mesh is None else mesh.ranks(axis)


def _size(axis: str, override: int | None = None) -> int:
    if override is not None:
        return override
    if not dist.is_initialized():
        return 1
    return get_parallel_mesh().size(axis)


def _rank(axis: str, override: int | None = None) -> int:
    if override is not None:
        return override
    if not dist.is_initialized():
        return 0
    return get_parallel_mesh().rank(axis)


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
    return _size(_tp(with_context_parallel), None if with_context_parallel else _state.tp_world_size)


def get_tp_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its tp (or tp x cp) group; the :func:`set_tensor_model_parallel_rank` value if set."""
    return _rank(_tp(with_context_parallel), None if with_context_parallel else _state.tp_rank)


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
    _state.tp_world_size = _override("world_size", world_size, minimum=1)


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Make the tp rank getters return ``rank`` (None: the group's again) until destroy."""
    _state.tp_rank = _override("rank", rank, minimum=0)


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
    return _size("pp", _state.pp_world_size)


def get_pp_rank() -> int:
    """This rank's pipeline stage; the :func:`set_pipeline_model_parallel_rank` value if set."""
    return _rank("pp", _state.pp_rank)


get_pipeline_model_parallel_group = get_pp_group
get_pipeline_model_parallel_world_size = get_pp_world_size
get_pipeline_model_parallel_rank = get_pp_rank


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Make the pp world-size getters return ``world_size`` (None: the group's again) until destroy."""
    _state.pp_world_size = _override("world_size", world_size, minimum=1)


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Make the pp rank getters return ``rank`` (None: the group's again) until destroy."""
    _state.pp_rank = _override("rank", rank, minimum=0)


def _pipeline_rank(stage: int) -> int:
    """Global rank of ``stage`` of this rank's pipeline (stages counted modulo the pp world size)."""
    ranks, size = get_parallel_mesh().ranks("pp"), get_pp_world_size()
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
    return _state.vpp_rank


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    """Set the current virtual pipeline stage (judged by ``is_pipeline_*_stage`` when no ``vp_stage`` is given)."""
    _state.vpp_rank = _override("rank", rank, minimum=0)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    """Virtual stages per pipeline rank (None: virtual pipelining off)."""
    return _state.vpp_world_size


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    """Set the number of virtual stages per pipeline rank (None: virtual pipelining off)."""
    _state.vpp_world_size = _override("world_size", world_size, minimum=1)


def _virtual_stage(vp_stage: int | None) -> int | None:
    """The virtual stage to judge: ``vp_stage``, else the set virtual rank; None when virtual pipelining is off."""
    if _state.vpp_world_size is None:
        return None
    stage = _state.vpp_rank if vp_stage is None else vp_stage
    if stage is None:
        raise ValueError(
            f"vp_stage must be given: virtual pipelining is on (virtual world size {_state.vpp_world_size}) and "
            "no virtual rank is set"
        )
    return stage


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on pipeline stage 0; with ``ignore_virtual=False`` and virtual pipelining, only in virtual stage 0."""
    if not ignore_virtual and _virtual_stage(vp_stage) not in (None, 0):
        return False
    return get_pp_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True on the last pipeline stage; with ``ignore_virtual=False`` and virtual pipelining, only in the last
    virtual stage."""
    if not ignore_virtual:
        stage = _virtual_stage(vp_stage)
        if stage is not None and stage != _state.vpp_world_size - 1:
            return False
    return get_pp_rank() == get_pp_world_size() - 1


# ---- embedding groups -------------------------------------------------------------------------------
def _embedding_group(kind: str, check_initialized: bool) -> dist.ProcessGroup | None:
    mesh = _mesh(check_initialized)
    if mesh is None:
        return None
    group = getattr(_state, f"{kind}_group")
    if group is not None or not check_initialized:
        return group
    name = kind.replace("_", "-")
    if not _state.built:
        raise NotInitializedError(
            f"no {name} group: it is built by initialize_model_parallel, and this mesh was built by init_parallel"
        )
    raise StateError(
        f"rank {mesh.global_rank} is in no {name} group: its pipeline {mesh.ranks('pp')} has {name} ranks "
        f"{getattr(_state, f'{kind}_ranks')}"
    )


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The group of the stages holding the word embeddings (default: first and last) of this rank's pipeline.

    StateError on a rank outside it (None with ``check_initialized=False``).
    """
    return _embedding_group("embedding", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """The group of the stages holding the position embeddings (default: the first) of this rank's pipeline.

    StateError on a rank outside it (None with ``check_initialized=False``).
    """
    return _embedding_group("position_embedding", check_initialized)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    """True if this rank holds embeddings; with ``ignore_virtual=False``, the first (last) embedding rank only in
    its first (last) virtual stage."""
    ranks = _state.embedding_ranks
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
    ranks = _state.position_embedding_ranks
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
    ``independent_all_gather=True`` raises: no separate all-gather group is built.
    """
    axis = _dp(with_context_parallel, partial_data_parallel)
    if with_context_parallel and independent_all_gather:
        raise StateError(
            "independent_all_gather=True: wf_mesh builds no separate all-gather group "
            "(create_all_gather_group is not supported); use get_data_parallel_group(with_context_parallel=True)"
        )
    return _group(axis, check_initialized)


def get_dp_group_gloo(
    with_context_parallel: bool = False, partial_data_parallel: bool = False, *, check_initialized: bool = True
) -> dist.ProcessGroup | None:
    """A Gloo group over the same ranks as :func:`get_dp_group` (the dp group itself when the backend is Gloo)."""
    axis = _dp(with_context_parallel, partial_data_parallel)
    mesh = _mesh(check_initialized)
    if mesh is None:
        return None
    if not _state.gloo:
        raise StateError("no Gloo groups: initialize_model_parallel was called with create_gloo_process_groups=False")
    gloo_axis = f"{axis}_gloo"
    return mesh.group(gloo_axis if gloo_axis in mesh.axes else axis)


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
    """The FP8 amax-reduction group, as Megatron picks it: tp x dp (tp x cp x dp with ``with_context_parallel``);
    with ``tp_only_amax_red=True``, tp (tp x cp)."""
    if tp_only_amax_red:
        return get_tp_group(check_initialized, with_context_parallel)
    return get_tensor_and_data_parallel_group(check_initialized, with_context_parallel)
