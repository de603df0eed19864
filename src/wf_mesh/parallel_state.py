"""Megatron / MAGI-1 ``parallel_state`` accessors, all reading the one :class:`~wf_mesh.mesh.ParallelMesh`.

Drop-in for code that does ``from megatron.core import parallel_state`` or uses MAGI's short names::

    from wf_mesh import parallel_state as mpu
    mpu.initialize_model_parallel(tp_size=2, cp_size=2)
    mpu.get_tensor_model_parallel_group(), mpu.get_cp_world_size(), mpu.get_dp_group(with_context_parallel=True)

Group accessors raise RuntimeError before initialization. When torch.distributed is off entirely,
world-size getters return 1 and rank getters 0 (a single process is a world of one).
Pipeline next/prev ranks wrap around: the pp group is a ring.

``cp_size_t`` (the temporal share of the CP degree) is set on this module by ``find_split`` and removed
by :func:`destroy_model_parallel`; position-embedding code reads it with ``hasattr``.
"""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path

import torch.distributed as dist

from wf_mesh import _compat
from wf_mesh.mesh import (
    get_parallel_mesh,
    init_parallel,
    parallel_mesh_or_none,
    register_destroy_hook,
    run_destroy_hooks,
)
from wf_mesh.topology import ParallelDims

__all__ = [
    # lifecycle
    "initialize_model_parallel",
    "destroy_model_parallel",
    "model_parallel_is_initialized",
    "is_initialized",
    "load_nccl_communicator_config",
    # MAGI-1 short names
    "get_tp_group",
    "get_tp_world_size",
    "get_tp_rank",
    "get_cp_group",
    "get_cp_world_size",
    "get_cp_rank",
    "get_pp_group",
    "get_pp_world_size",
    "get_pp_rank",
    "get_dp_group",
    "get_dp_group_gloo",
    "get_dp_world_size",
    "get_dp_rank",
    # Megatron names
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_ranks",
    "get_tensor_model_parallel_last_rank",
    "get_tensor_and_context_parallel_group",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_context_parallel_rank",
    "get_context_parallel_group",
    "get_context_parallel_world_size",
    "get_context_parallel_rank",
    "get_context_parallel_global_ranks",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_data_parallel_group",
    "get_data_parallel_group_gloo",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "get_model_parallel_group",
]

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


def initialize_model_parallel(
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-pp-dp",
) -> None:
    """Build the process-wide mesh (Megatron signature); dp = world_size // (tp * pp * cp).

    Raises:
        RuntimeError: torch.distributed not initialized; world size not divisible by tp*pp*cp (every factor
            named); already initialized (call :func:`destroy_model_parallel` first).
        ValueError: a bad degree or order string.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed: call torch.distributed.init_process_group(...) "
            "or wf_mesh.dist_init(config) first"
        )
    world_size = dist.get_world_size()
    dims = ParallelDims(tp=tp_size, cp=cp_size, pp=pp_size, dp=-1, order=order)
    model_size = tp_size * pp_size * cp_size
    if world_size % model_size:
        raise RuntimeError(
            f"world_size={world_size} is not divisible by tp_size*pp_size*cp_size = "
            f"{tp_size}*{pp_size}*{cp_size} = {model_size}"
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
    init_parallel(
        dims,
        timeout=datetime.timedelta(minutes=distributed_timeout_minutes),
        nccl_config=nccl_config,
    )


def destroy_model_parallel(destroy_process_groups: bool = True) -> None:
    """Destroy the subgroups wf_mesh created and clear all model-parallel state.

    The default process group is left alive: the launcher owns it. Pass ``destroy_process_groups=False``
    only when an external framework has already destroyed the subgroups. Safe to call when nothing is
    initialized.
    """
    mesh = parallel_mesh_or_none()
    if mesh is not None:
        mesh.destroy(destroy_process_groups)
    else:
        run_destroy_hooks()


def _reset_module_state() -> None:
    globals().pop("cp_size_t", None)


register_destroy_hook(_reset_module_state)


def model_parallel_is_initialized() -> bool:
    """True once :func:`initialize_model_parallel` (or ``init_parallel``) has built the mesh."""
    return parallel_mesh_or_none() is not None


def is_initialized() -> bool:
    """Megatron alias of :func:`model_parallel_is_initialized`."""
    return model_parallel_is_initialized()


# ---- helpers ----------------------------------------------------------------------------------------
def _group(axis: str) -> dist.ProcessGroup:
    return get_parallel_mesh().group(axis)


def _size(axis: str) -> int:
    if not dist.is_initialized():
        return 1
    return get_parallel_mesh().size(axis)


def _rank(axis: str) -> int:
    if not dist.is_initialized():
        return 0
    return get_parallel_mesh().rank(axis)


def _tp(with_context_parallel: bool) -> str:
    return "tp_cp" if with_context_parallel else "tp"


def _dp(with_context_parallel: bool) -> str:
    return "dp_cp" if with_context_parallel else "dp"


# ---- tensor parallel --------------------------------------------------------------------------------
def get_tp_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """This rank's tp group (tp x cp with ``with_context_parallel=True``)."""
    return _group(_tp(with_context_parallel))


def get_tp_world_size(with_context_parallel: bool = False) -> int:
    return _size(_tp(with_context_parallel))


def get_tp_rank(with_context_parallel: bool = False) -> int:
    return _rank(_tp(with_context_parallel))


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    """Megatron's tp group (None if not initialized and ``check_initialized=False``)."""
    if not check_initialized and parallel_mesh_or_none() is None:
        return None
    return _group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_tensor_model_parallel_ranks(with_context_parallel: bool = False) -> list[int]:
    """Global ranks of this rank's tp (or tp x cp) group, in group order."""
    return get_parallel_mesh().ranks(_tp(with_context_parallel))


def get_tensor_model_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first member of this rank's tp (or tp x cp) group."""
    return get_tensor_model_parallel_ranks(with_context_parallel)[0]


def get_tensor_model_parallel_last_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the last member of this rank's tp (or tp x cp) group."""
    return get_tensor_model_parallel_ranks(with_context_parallel)[-1]


def get_tensor_and_context_parallel_group() -> dist.ProcessGroup:
    return _group("tp_cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _rank("tp_cp")


# ---- context parallel -------------------------------------------------------------------------------
def get_cp_group() -> dist.ProcessGroup:
    return _group("cp")


def get_cp_world_size() -> int:
    return _size("cp")


def get_cp_rank() -> int:
    return _rank("cp")


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup | None:
    if not check_initialized and parallel_mesh_or_none() is None:
        return None
    return _group("cp")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_context_parallel_global_ranks() -> list[int]:
    return get_parallel_mesh().ranks("cp")


# ---- pipeline parallel ------------------------------------------------------------------------------
def get_pp_group() -> dist.ProcessGroup:
    return _group("pp")


def get_pp_world_size() -> int:
    return _size("pp")


def get_pp_rank() -> int:
    return _rank("pp")


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return _group("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    return get_pp_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    return get_pp_rank() == get_pp_world_size() - 1


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of stage 0 in this rank's pipeline."""
    return get_parallel_mesh().ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage in this rank's pipeline."""
    return get_parallel_mesh().ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage; the last stage's next is stage 0 (a ring)."""
    ranks = get_parallel_mesh().ranks("pp")
    return ranks[(get_pp_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage; stage 0's previous is the last stage (a ring)."""
    ranks = get_parallel_mesh().ranks("pp")
    return ranks[(get_pp_rank() - 1) % len(ranks)]


# ---- data parallel ----------------------------------------------------------------------------------
def get_dp_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """This rank's dp group (dp x cp, the FSDP axis, with ``with_context_parallel=True``)."""
    return _group(_dp(with_context_parallel))


def get_dp_group_gloo(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """A gloo group over the same ranks as :func:`get_dp_group` (the dp group itself when the backend is gloo)."""
    mesh = get_parallel_mesh()
    axis = _dp(with_context_parallel)
    gloo_axis = f"{axis}_gloo"
    return mesh.group(gloo_axis if gloo_axis in mesh.axes else axis)


def get_dp_world_size(with_context_parallel: bool = False) -> int:
    return _size(_dp(with_context_parallel))


def get_dp_rank(with_context_parallel: bool = False) -> int:
    return _rank(_dp(with_context_parallel))


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    return get_dp_group(with_context_parallel)


def get_data_parallel_group_gloo(with_context_parallel: bool = False) -> dist.ProcessGroup:
    return get_dp_group_gloo(with_context_parallel)


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return get_dp_world_size(with_context_parallel)


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return get_dp_rank(with_context_parallel)


# ---- model parallel ---------------------------------------------------------------------------------
def get_model_parallel_group() -> dist.ProcessGroup:
    """Megatron's model-parallel group: tp x pp (it excludes cp)."""
    return _group("tp_pp")

