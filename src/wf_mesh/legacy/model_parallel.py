"""Megatron-LM / MAGI-1 model-parallel lifecycle: ``initialize_model_parallel`` (MAGI-1's positional arguments
and Megatron's keywords mapped onto one :func:`~wf_mesh.mesh.init_parallel`, unsupported features refused,
Megatron's embedding groups), ``destroy_model_parallel``, Megatron's Gloo groups (made on first request), and
the per-process :data:`state` the accessors of :mod:`wf_mesh.parallel_state` read (overrides, virtual pipeline,
embedding and Gloo groups; the mesh extension ``"legacy.megatron"``). Users import all of it from
:mod:`wf_mesh.parallel_state`; see its docstring for the contract.
"""

from __future__ import annotations

import dataclasses
import datetime
import numbers
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from wf_mesh import _compat, agreement, topology
from wf_mesh.errors import DegreeError
from wf_mesh.legacy.errors import LegacyNotInitializedError, LegacyStateError, asserting
from wf_mesh.mesh import (
    ParallelMesh,
    init_parallel,
    parallel_mesh_or_none,
    register_extension,
    reset_extensions,
)
from wf_mesh.topology import ParallelDims, as_int

__all__ = [
    "DEFAULT_ORDER",
    "MEGATRON_ORDER",
    "State",
    "current_mesh",
    "data_parallel_gloo_group",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "destroy_model_parallel",
    "initialize_model_parallel",
    "load_nccl_communicator_config",
    "state",
]

DEFAULT_ORDER = topology.DEFAULT_ORDER
"""wf_mesh's and MAGI-1's default rank order (tp fastest, dp slowest; cfg, always 1 here, before dp)."""

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
class State:
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
    gloo_groups: dict[str, dist.ProcessGroup] | None = None  # "dp" / "dp_cp" -> gloo group, on first request
    created: list[dist.ProcessGroup] = dataclasses.field(default_factory=list)  # new_group'ed, this rank a member


state = State()


# ---- lifecycle --------------------------------------------------------------------------------------
def load_nccl_communicator_config(path: str | Path) -> dict[str, dict[str, int]]:
    """Read Megatron's per-group NCCL communicator YAML and return it keyed by wf_mesh axis name.

    The file maps group names (``dp``, ``dp_cp``, ``cp``, ``mp``, ``tp``, ``tp_cp``, ``pp``, ``tp_cp_dp``,
    ``tp_dp``) to ``{min_ctas, max_ctas, cga_cluster_size}`` integers. Needs PyYAML (``pip install pyyaml``).

    Returns:
        The options of each group in the file, keyed by the axis of its ranks (``mp`` is ``tp_pp``).

    Raises:
        ImportError: PyYAML is not installed.
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not YAML, not a mapping, names an unknown group, or gives options other than
            integer ``min_ctas``, ``max_ctas``, ``cga_cluster_size``.
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
            k in _compat.NCCL_OPTION_KEYS and isinstance(v, int) and not isinstance(v, bool) for k, v in options.items()
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
        tp_size: tensor-parallel degree (MAGI-1's spelling; give one of the two).
        pp_size: pipeline-parallel degree (MAGI-1's spelling).
        cp_size: context-parallel degree (MAGI-1's spelling).
        nccl_communicator_config_path: Megatron's per-group NCCL YAML (:func:`load_nccl_communicator_config`);
            ignored, with a warning, when the backend is not NCCL.
        distributed_timeout_minutes: timeout of the subgroups' collectives.
        order: rank order, fastest axis first; default :data:`DEFAULT_ORDER` (Megatron's is
            :data:`MEGATRON_ORDER`); its ``ep`` is one of :data:`~wf_mesh.topology.UNSHARDED_AXES`, which
            ParallelDims accepts and drops.
        tensor_model_parallel_size: Megatron's spelling of ``tp_size``.
        pipeline_model_parallel_size: Megatron's spelling of ``pp_size``.
        virtual_pipeline_model_parallel_size: virtual stages per pipeline rank (interleaved schedule); needs
            pp > 1. Sets the virtual world size to it and the virtual rank to 0.
        pipeline_model_parallel_comm_backend: None or the default group's backend.
        use_sharp: must be False (SHARP is not supported).
        context_parallel_size: Megatron's spelling of ``cp_size``.
        hierarchical_context_parallel_sizes: must be empty (hierarchical cp is not supported).
        hybrid_context_parallel: must be False (hybrid cp is not supported).
        expert_model_parallel_size: must be 1 (expert parallelism is not supported).
        num_distributed_optimizer_instances: must be 1 (partial data parallel is not supported).
        expert_tensor_parallel_size: None or the tensor-parallel size.
        get_embedding_ranks: ``f(pipeline_ranks) -> ranks`` choosing which stages of each pipeline hold the
            embeddings; default :func:`default_embedding_ranks`. Must return distinct ranks of that pipeline.
        get_position_embedding_ranks: the same for the position embeddings; default
            :func:`default_position_embedding_ranks`.
        create_gloo_process_groups: False makes the Gloo getters raise (as in Megatron).
        high_priority_stream_groups: must be empty (high-priority NCCL streams are not supported).
        sharp_enabled_group: must be None (SHARP is not supported).
        create_all_gather_group: must be False or None (a second dp x cp communicator is not supported).
        encoder_tensor_model_parallel_size: must be 0 or None (the encoder pipeline is not supported).
        encoder_pipeline_model_parallel_size: must be 0 or None (the encoder pipeline is not supported).
        pipeline_model_parallel_split_rank: must be None (the encoder pipeline is not supported).

    Raises:
        TypeError: both spellings of a degree, a callable or flag of the wrong type (this rank, at once);
            a degree that is not an int (every rank).
        NotImplementedError: an unsupported feature (this rank, at once; see the module docstring).
        LegacyStateError (a StateError and an AssertionError): torch.distributed is not initialized (this rank),
            or model parallel is already initialized (every rank).
        DegreeError (a ValueError and a RuntimeError): the degrees do not fit the world size or each other,
            or virtual pipelining without pp > 1 (every rank, naming the factors and the rank(s)).
        DisagreementError: ranks passed different degrees, order, timeout, virtual size or embedding ranks.
        ValueError: an embedding-rank function returned ranks outside its pipeline (every rank).
    """
    degrees = {
        "tp": _one_spelling("tp_size", tp_size, "tensor_model_parallel_size", tensor_model_parallel_size),
        "pp": _one_spelling("pp_size", pp_size, "pipeline_model_parallel_size", pipeline_model_parallel_size),
        "cp": _one_spelling("cp_size", cp_size, "context_parallel_size", context_parallel_size),
    }
    choosers = {"embedding": get_embedding_ranks, "position_embedding": get_position_embedding_ranks}
    _check_callables_and_flags(choosers, create_gloo_process_groups)
    timeout = timeout_minutes(distributed_timeout_minutes)
    _refuse_unsupported(
        _or_one(degrees["tp"]),
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
    _require_distributed(pipeline_model_parallel_comm_backend)
    nccl_config = _nccl_config(nccl_communicator_config_path)
    with asserting():  # "already initialized" is Megatron's AssertionError, on every rank
        plan = _agree_on_plan(
            degrees, order, virtual_pipeline_model_parallel_size, choosers, create_gloo_process_groups
        )
        mesh = init_parallel(plan.dims, timeout=timeout, nccl_config=nccl_config)
    _record_plan(mesh, plan)


def _check_callables_and_flags(choosers: Mapping[str, object], create_gloo_process_groups: object) -> None:
    """TypeError for an embedding-rank chooser that is not callable or a gloo flag that is not a bool."""
    for kind, fn in choosers.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"get_{kind}_ranks must be a callable f(pipeline_ranks) -> ranks or None, got {fn!r}")
    if not isinstance(create_gloo_process_groups, bool):
        raise TypeError(f"create_gloo_process_groups must be a bool, got {create_gloo_process_groups!r}")


def _require_distributed(pipeline_backend: str | None) -> None:
    """LegacyStateError without torch.distributed; NotImplementedError for a pipeline backend of its own."""
    if not dist.is_initialized():
        raise LegacyStateError(
            "initialize_model_parallel needs torch.distributed: call torch.distributed.init_process_group(...) "
            "or wf_mesh.dist_init(config) first"
        )
    if pipeline_backend not in (None, dist.get_backend()):
        raise NotImplementedError(
            f"initialize_model_parallel: pipeline_model_parallel_comm_backend={pipeline_backend!r}"
            f" is not supported: pipeline groups use the default group's backend {dist.get_backend()!r}"
        )


def _nccl_config(path: str | None) -> dict[str, dict[str, int]] | None:
    """The communicator YAML at ``path`` keyed by axis; None (with a warning) when the backend is not NCCL."""
    if path is None:
        return None
    config = load_nccl_communicator_config(path)
    if dist.get_backend() != "nccl":
        warnings.warn(
            f"nccl_communicator_config_path={path!r} ignored: backend is {dist.get_backend()!r}, not 'nccl'",
            stacklevel=3,
        )
        return None
    return config


def _one_spelling(short: str, short_value: int | None, long: str, long_value: int | None) -> int | None:
    if short_value is not None and long_value is not None:
        raise TypeError(
            f"initialize_model_parallel got both {short}={short_value!r} and {long}={long_value!r}: they are the "
            "same degree, pass one"
        )
    return long_value if short_value is None else short_value


def _or_one(value: int | None) -> int:
    return 1 if value is None else value


def timeout_minutes(minutes: float, name: str = "distributed_timeout_minutes") -> datetime.timedelta:
    """A positive number of minutes as a timedelta; TypeError / ValueError name ``name`` and the value."""
    if isinstance(minutes, bool) or not isinstance(minutes, numbers.Real):
        raise TypeError(f"{name} must be a number of minutes, got {type(minutes).__name__} {minutes!r}")
    if not minutes > 0:
        raise ValueError(f"{name}={minutes!r} must be > 0")
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
        (
            "expert_tensor_parallel_size",
            expert_tensor_parallel_size,
            f"a separate expert tensor-parallel layout; tensor_model_parallel_size={tp}",
            expert_tensor_parallel_size not in (None, tp),
        ),
        (
            "hierarchical_context_parallel_sizes",
            hierarchical_context_parallel_sizes,
            "hierarchical cp",
            bool(hierarchical_context_parallel_sizes),
        ),
        ("hybrid_context_parallel", hybrid_context_parallel, "hybrid cp", bool(hybrid_context_parallel)),
        ("use_sharp", use_sharp, "SHARP", bool(use_sharp)),
        ("sharp_enabled_group", sharp_enabled_group, "SHARP", sharp_enabled_group is not None),
        (
            "num_distributed_optimizer_instances",
            num_distributed_optimizer_instances,
            "partial data parallel",
            num_distributed_optimizer_instances != 1,
        ),
        (
            "create_all_gather_group",
            create_all_gather_group,
            "a second dp x cp communicator",
            bool(create_all_gather_group),
        ),
        (
            "high_priority_stream_groups",
            high_priority_stream_groups,
            "high-priority NCCL streams",
            bool(high_priority_stream_groups),
        ),
        (
            "encoder_tensor_model_parallel_size",
            encoder_tensor_model_parallel_size,
            "encoder pipeline",
            encoder_tensor_model_parallel_size not in (0, None),
        ),
        (
            "encoder_pipeline_model_parallel_size",
            encoder_pipeline_model_parallel_size,
            "encoder pipeline",
            encoder_pipeline_model_parallel_size not in (0, None),
        ),
        (
            "pipeline_model_parallel_split_rank",
            pipeline_model_parallel_split_rank,
            "encoder pipeline",
            pipeline_model_parallel_split_rank is not None,
        ),
    ]
    refused = [f"{name}={value!r} ({what})" for name, value, what, on in checks if on]
    if refused:
        raise NotImplementedError(
            f"initialize_model_parallel: not supported by wf_mesh (dense tp/cp/pp/dp only): {', '.join(refused)}"
        )


@dataclasses.dataclass(frozen=True)
class _PlanFacts(agreement.Facts):
    """What :func:`initialize_model_parallel` agrees on besides the mesh (which ``init_parallel`` agrees on)."""

    vpp: int | None = agreement.fact(label="virtual_pipeline_model_parallel_size")
    embedding_crc: int = agreement.fact(label="embedding ranks")
    position_embedding_crc: int = agreement.fact(label="position embedding ranks")
    gloo: bool = agreement.fact(label="create_gloo_process_groups")
    dims: ParallelDims = agreement.fact(local=True)
    embedding_ranks: dict = agreement.fact(local=True)  # kind -> each pipeline's (position-)embedding ranks


def _agree_on_plan(
    degrees: dict[str, int | None],
    order: str,
    vpp: int | None,
    choosers: dict[str, Callable[[list[int]], list[int]] | None],
    gloo: bool,
) -> _PlanFacts:
    """Judge the degrees (ParallelDims), the virtual size and the embedding ranks on every rank and agree on
    them (one all-gather): every rank gets the same verdict.

    Returns:
        This rank's plan.
    """
    tp, pp, cp = (_or_one(degrees[axis]) for axis in ("tp", "pp", "cp"))
    world_size = dist.get_world_size()
    defaults = {"embedding": default_embedding_ranks, "position_embedding": default_position_embedding_ranks}

    def facts() -> _PlanFacts:
        current = parallel_mesh_or_none()
        if current is not None:
            raise LegacyStateError(
                f"model parallel is already initialized ({current.dims}); call "
                "wf_mesh.destroy_model_parallel() before initializing again"
            )
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
        return _PlanFacts(
            vpp=size,
            embedding_crc=_crc(ranks["embedding"]),
            position_embedding_crc=_crc(ranks["position_embedding"]),
            gloo=gloo,
            dims=dims,
            embedding_ranks=ranks,
        )

    world_group: Any = dist.group.WORLD
    agreed = agreement.agree(world_group, facts, what="initialize_model_parallel", required=True)
    hint = "; every rank must pass the same arguments"
    agreed.require_same("vpp", hint=hint)
    for kind in defaults:

        def crc(row: _PlanFacts, kind: str = kind) -> str:
            return f"crc {getattr(row, f'{kind}_crc'):08x}"

        agreed.require_same(key=crc, label=_PlanFacts.label(f"{kind}_crc"), hint=hint)
    agreed.require_same("gloo", hint=hint)
    assert agreed.mine is not None  # required: the exchange ran and this rank's facts are known
    return agreed.mine


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


def _record_plan(mesh: ParallelMesh, plan: _PlanFacts) -> None:
    """The legacy state of a new mesh: embedding groups (the mesh is destroyed if building them fails), the
    Gloo switch and the virtual pipeline."""
    try:
        _build_embedding_groups(mesh, plan.embedding_ranks)
    except BaseException:
        destroy_model_parallel()
        raise
    state.gloo = plan.gloo
    if plan.vpp is not None:
        state.vpp_world_size, state.vpp_rank = plan.vpp, 0


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
                    state.created.append(created)
            if pp_ranks == mine:
                setattr(state, f"{kind}_ranks", ranks)
                setattr(state, f"{kind}_group", group)
    state.built = True


NOT_INITIALIZED = (
    "model parallel is not initialized: call wf_mesh.initialize_model_parallel(...) (or wf_mesh.dist_init / "
    "wf_mesh.init_from_env) first"
)


def current_mesh() -> ParallelMesh:
    """The current mesh, for the legacy accessors.

    Returns:
        The process-wide :class:`~wf_mesh.mesh.ParallelMesh`.

    Raises:
        LegacyNotInitializedError: none is initialized (Megatron asserts there), in the legacy API's words.
    """
    mesh = parallel_mesh_or_none()
    if mesh is None:
        raise LegacyNotInitializedError(NOT_INITIALIZED)
    return mesh


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
        reset_extensions(destroy_process_groups)


def data_parallel_gloo_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """This rank's Gloo group over the ranks of its dp (``with_context_parallel``: dp x cp) group, for CPU-side
    work (Megatron's ``get_data_parallel_group_gloo``).

    The Gloo groups (dp and dp x cp at once) are created on the first request after the mesh was built and
    destroyed with it. Creating groups is collective over the whole world: every rank must make that first
    call (of either kind), as every rank does in Megatron, where they are built at initialization.

    Returns:
        The Gloo process group holding this rank.

    Raises:
        LegacyNotInitializedError: model parallel is not initialized.
        LegacyStateError: initialize_model_parallel was called with ``create_gloo_process_groups=False``.
    """
    mesh = current_mesh()
    if not state.gloo:
        raise LegacyStateError(
            "no Gloo groups: initialize_model_parallel was called with create_gloo_process_groups=False"
        )
    if state.gloo_groups is None:
        state.gloo_groups = _build_gloo_groups(mesh)
    return state.gloo_groups["dp_cp" if with_context_parallel else "dp"]


def _build_gloo_groups(mesh: ParallelMesh) -> dict[str, dist.ProcessGroup]:
    """Every dp and dp x cp group again on Gloo (every rank creates all of them, in the same order)."""
    mine: dict[str, dist.ProcessGroup] = {}
    for axis in ("dp", "dp_cp"):
        if axis == "dp_cp" and mesh.dims.cp == 1:  # the same ranks as dp
            mine[axis] = mine["dp"]
            continue
        for ranks in mesh.dims.iter_groups(axis):
            group = dist.new_group(ranks, timeout=mesh.timeout, backend="gloo")
            if mesh.global_rank in ranks:
                mine[axis] = group
                state.created.append(group)
    return mine


def _reset(destroy_process_groups: bool) -> None:
    """Forget the overrides, the virtual pipeline, the embedding and Gloo groups (destroying the groups this
    module created)."""
    global state
    created, state = state.created, State()
    if destroy_process_groups and dist.is_initialized():
        for group in created:
            dist.destroy_process_group(group)


register_extension("legacy.megatron", _reset)
