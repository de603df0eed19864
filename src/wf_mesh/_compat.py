"""The one module that touches private torch API or depends on torch internals.

Everything here is a small, named shim so that a torch upgrade is fixed in one place:

- ``all_gather_single`` / ``reduce_scatter_single``: torch 2.13's names of ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` (the same calls), with the old names before 2.13. Public but version-gated, so
  every caller goes through here (``tests/test_private_api.py`` keeps a deny-list of such names).
- ``flatten`` / ``unflatten``: ``DeviceMesh._flatten`` builds a 1-D mesh (and its process groups) over several
  axes; ``DeviceMesh._unflatten`` splits one axis into several (the cp sub-axes of USP attention), given by index
  since torch 2.11 refuses an existing axis name.
- ``default_group_timeout`` / ``group_timeout``: a group's timeout lives on its backend's private options.
- ``backend_options``: per-group options (``ProcessGroupGloo._Options``, ``ProcessGroupNCCL.Options``) carrying
  the timeout; ``new_group`` otherwise falls back to torch's global 30-minute default, not the timeout the
  default group was created with.
- ``release_meshes``: destroys the process groups a set of meshes created, and breaks the reference
  cycle between a root DeviceMesh and its flattened children (``root._flatten_mapping`` <->
  ``child._root_mesh``). Until every reference is dropped, gloo groups keep their sockets open even after
  ``destroy_process_group``, so repeated init/destroy would leak file descriptors.
- ``register_fake_backend``: the ``fake`` backend (one process pretending to be rank r of N) is
  registered by a module under ``torch.testing._internal``.
- ``process_groups`` / ``new_group_calls``: the groups this process holds and the ``new_group`` calls made,
  read from ``distributed_c10d._world`` (``wf_mesh.testing`` counts and cleans up groups with them).
- ``dtensor_local`` / ``wait_if_async`` / ``reshard_fsdp_modules`` / ``fsdp_param_groups`` (shard-local EMA and
  state broadcast; FSDP2's parameter groups are a list from torch 2.12, one optional group before):
  ``DTensor._local_tensor`` is the shard object itself (``to_local()`` on an ``nn.Parameter`` DTensor returns a
  fresh view per call, useless for cheap identity checks); ``AsyncCollectiveTensor`` lives in a private
  module; FSDP2 exposes no public "is this module resharded?" query.
- ``parameter_registry``: a module's own ``_parameters`` dict (the EMA follows re-registered parameters by
  identity, cheaper than ``named_parameters()`` per call).
- ``foreach_copy_`` / ``foreach_lerp_`` / ``foreach_mul_`` / ``foreach_add_``: torch's multi-tensor kernels
  (``torch._foreach_*``, one launch per (device, dtype) group instead of one per tensor).
- ``clear_dtensor_caches`` (called by ``release_meshes``; ``wf_mesh.testing`` after each test): DTensor's
  sharding-propagation and redistribute caches key on DeviceMesh equality (ranks, layout, names; not process
  groups), so after destroy + init a new, equal mesh would get cached specs that hold the OLD mesh and its
  destroyed groups ("Could not resolve the process group registered under the name ..."). ``mesh_is_live``
  asks the same registry whether a mesh's groups still exist.
- ``flash_attention_cpu`` / ``flash_attention_cpu_backward`` (CP attention): ``F.scaled_dot_product_attention``
  does not return the row log-sum-exp needed to merge partial results over key blocks; the aten ops behind
  its CPU flash path do, and take it back for a blockwise backward.
- ``flash_attention_cuda`` / ``efficient_attention_cuda`` / ``cudnn_attention_cuda`` and their ``*_backward``
  (CP attention on CUDA, chosen by ``wf_mesh.attention_kernels``): the same for the three fused CUDA kernels of
  SDPA (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention``), each with its own log-sum-exp shape
  and padding quirks, handled here so that every caller sees ``(out, lse (B, H, Sq) fp32)``.
- ``fake_tensor_mode`` / ``fake_store`` / ``outside_fake_mode`` (``wf_mesh.testing``'s fake-CUDA harness and
  the agreement exchange of CP attention): ``FakeTensorMode`` and ``FakeStore`` live in private modules, and
  host-side metadata (the agreement's rows, read with ``.tolist()``) must be real tensors even while a fake
  mode is active.
- ``resolve_group`` / ``constant_at_trace`` / ``graph_breaks`` (CP attention under ``torch.compile``): the
  custom ops of the compiled path take a group by its name, and ``distributed_c10d._resolve_process_group``
  finds it; ``torch._dynamo.assume_constant_result`` runs the host-side planning eagerly while dynamo traces
  and bakes its result into the graph; ``torch._dynamo.explain`` counts graph breaks and ``compile_backend`` looks a backend up to wrap it
  (tests, benchmarks).
- ``dispatch_mode``: CommDebugMode counts collectives only; counting point-to-point ops too needs a dispatch
  mode, whose base class lives in ``torch.utils._python_dispatch`` (``wf_mesh.testing.c10d_ops`` builds on it).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "all_gather_single",
    "backend_options",
    "clear_dtensor_caches",
    "default_group_timeout",
    "group_timeout",
    "dispatch_mode",
    "cudnn_attention_cuda",
    "cudnn_attention_cuda_backward",
    "dtensor_local",
    "efficient_attention_cuda",
    "efficient_attention_cuda_backward",
    "fake_store",
    "fake_tensor_mode",
    "flash_attention_cpu",
    "flash_attention_cpu_backward",
    "flash_attention_cuda",
    "flash_attention_cuda_backward",
    "flatten",
    "foreach_add_",
    "foreach_copy_",
    "foreach_lerp_",
    "foreach_mul_",
    "mesh_group_names",
    "mesh_is_live",
    "new_group_calls",
    "outside_fake_mode",
    "parameter_registry",
    "process_groups",
    "register_fake_backend",
    "release_meshes",
    "fsdp_param_groups",
    "reduce_scatter_single",
    "reshard_fsdp_modules",
    "unflatten",
    "wait_if_async",
]

NCCL_OPTION_KEYS = ("cga_cluster_size", "max_ctas", "min_ctas")

# torch 2.13 renamed the single-tensor collectives (same arguments; the old names warn from then on)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def flatten(submesh: DeviceMesh, name: str, options: Any | None = None) -> DeviceMesh:
    """Flatten ``submesh`` (sliced from a root mesh) into a 1-D mesh called ``name``; creates its groups."""
    return submesh._flatten(name, backend_override=options)


def unflatten(
    mesh: DeviceMesh, axis: str, sizes: tuple[int, ...], names: tuple[str, ...], options: Mapping[str, Any] | None
) -> DeviceMesh:
    """Split ``mesh``'s ``axis`` into ``names`` of ``sizes`` (first slowest); creates the new axes' groups only."""
    # by index: torch 2.11's _unflatten rejects an axis *name* that exists (its membership check is inverted)
    dim = list(mesh.mesh_dim_names or ()).index(axis)
    return mesh._unflatten(dim, sizes, names, backend_override=dict(options) if options else None)


def default_group_timeout() -> datetime.timedelta:
    """The timeout the default process group was created with.

    Returns:
        That timeout; torch's default for its backend where the backend keeps no options (the ``fake`` one).
    """
    return group_timeout(dist.distributed_c10d._get_default_group())


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The timeout ``group``'s collectives wait for.

    Returns:
        That timeout; torch's default for its backend where the backend keeps no options (the ``fake`` one).
    """
    backend = dist.get_backend(group)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    options = getattr(group._get_backend(device), "options", None)
    if options is None:
        return dist.distributed_c10d._get_default_timeout(backend)
    return options._timeout


def backend_options(
    backend: str, timeout: datetime.timedelta, nccl_config: Mapping[str, int] | None = None
) -> Any | None:
    """Options object for one mesh axis's process groups on ``backend``, carrying ``timeout``.

    ``nccl_config`` holds NCCL communicator settings (``min_ctas``, ``max_ctas``, ``cga_cluster_size``).

    Returns:
        The backend's options, or None for backends without an options type (the global default timeout then
        applies).
    """
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: not in torch's stubs
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        for key, value in (nccl_config or {}).items():
            setattr(opts.config, key, value)
    else:
        return None
    opts._timeout = timeout
    return opts


def mesh_group_names(mesh: DeviceMesh) -> list[str]:
    """Names of the process groups a mesh owns, one per mesh dim (empty if this rank is outside it)."""
    return list(getattr(mesh, "_dim_group_names", []))


def mesh_is_live(mesh: DeviceMesh) -> bool:
    """Whether the process groups of ``mesh`` still exist.

    Returns:
        False once they were destroyed (torch would fail with "Could not resolve the process group registered
        under the name ...").
    """
    try:
        for name in mesh_group_names(mesh):
            dist.distributed_c10d._resolve_process_group(dist.distributed_c10d.GroupName(name))
    except (RuntimeError, ValueError, KeyError):
        return False
    return True


def release_meshes(root: DeviceMesh, derived: Iterable[DeviceMesh], destroy_groups: bool = True) -> None:
    """Destroy the process groups of ``root`` and the meshes ``derived`` from it (never the default group)
    and break the root <-> child reference cycle so the groups' sockets close now."""
    derived = list(derived)
    if destroy_groups and dist.is_initialized():
        default = dist.group.WORLD
        seen: set[str] = set()
        for mesh in [root, *derived]:
            for name in mesh_group_names(mesh):
                if name in seen:
                    continue
                seen.add(name)
                pg = dist.distributed_c10d._resolve_process_group(dist.distributed_c10d.GroupName(name))
                if pg is not None and pg is not default and pg != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(pg)
    for mesh in derived:
        mesh._root_mesh = None
        mesh._pg_registry = {}
    root._flatten_mapping = {}
    root._pg_registry = {}
    clear_dtensor_caches()


def register_fake_backend() -> None:
    """Register torch's ``fake`` backend (for topology checks at thousands of simulated ranks)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers on import)


def process_groups() -> list[dist.ProcessGroup]:
    """Every process group this process holds, the default one included."""
    return list(dist.distributed_c10d._world.pg_map)


def new_group_calls() -> int:
    """How many ``new_group`` calls this process made so far (non-member calls included: they create no group
    on this rank but still advance torch's group counter).

    Returns:
        The count.
    """
    return dist.distributed_c10d._world.group_count


# ---- shard-local state (ema.py, state_sync.py) ----------------------------------------------------------
def parameter_registry(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """``module``'s own parameters by attribute name (not its children's).

    Returns:
        The live dict ``register_parameter`` writes, so that an identity check against it sees a
        re-registered parameter.
    """
    return module._parameters


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i, as one multi-tensor kernel per (device, dtype) group."""
    torch._foreach_copy_(dst, src)


def foreach_lerp_(dst: list[torch.Tensor], end: list[torch.Tensor], weight: float) -> None:
    """``dst[i].lerp_(end[i], weight)`` for every i (same dtypes), as multi-tensor kernels."""
    torch._foreach_lerp_(dst, end, weight)


def foreach_mul_(dst: list[torch.Tensor], scalar: float) -> None:
    """``dst[i].mul_(scalar)`` for every i, as multi-tensor kernels."""
    torch._foreach_mul_(dst, scalar)


def foreach_add_(dst: list[torch.Tensor], other: list[torch.Tensor], *, alpha: float = 1.0) -> None:
    """``dst[i].add_(other[i], alpha=alpha)`` for every i (``other`` may have another dtype), as multi-tensor
    kernels."""
    torch._foreach_add_(dst, other, alpha=alpha)


def dtensor_local(dtensor: DTensor) -> torch.Tensor:
    """The local shard object a DTensor holds (no view, no autograd): stable identity while the shard is."""
    return dtensor._local_tensor


def wait_if_async(tensor: torch.Tensor) -> torch.Tensor:
    """Wait on an ``AsyncCollectiveTensor`` (what ``DTensor.to_local()`` may return) and return the result."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def reshard_fsdp_modules(model: torch.nn.Module) -> None:
    """Reshard every FSDP2 module of ``model`` whose parameters are not in the sharded state (FSDP2 keeps
    them unsharded after forward until backward when ``reshard_after_forward`` is False, as for the root);
    the next forward or backward gathers them again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule) and not all(group.is_sharded for group in fsdp_param_groups(module)):
            module.reshard()


def fsdp_param_groups(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of a ``fully_shard``-ed module."""
    # a list since torch 2.12; one optional group (``_fsdp_param_group``) before
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding propagations and redistribute plans (they may hold destroyed meshes)."""
    from torch.distributed.tensor import _redistribute, debug

    debug._clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


# ---- fused CPU attention with log-sum-exp (attention.py) -------------------------------------------------
# ``F.scaled_dot_product_attention`` does not return the row log-sum-exp that context-parallel attention
# needs to merge partial results over key blocks, nor take it back for a blockwise backward; the aten ops
# behind its CPU flash path do both.


def flash_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of CPU tensors ``(B, H, S, D)`` (the flash kernel of SDPA).

    ``lse`` is ``(B, H, Sq)``, fp32 (float64 for float64 inputs: its backward then needs a float64 lse).
    ``bias``: additive float mask in q's dtype, broadcastable to ``(B, H, Sq, Sk)``. k/v may have fewer heads than q (grouped as ``enable_gqa=True``).
    Quirks the caller handles: a row whose keys are all masked gets out 0 and lse 0 (not -inf), and a
    key length of 0 crashes the process (SIGFPE).

    Returns:
        ``(out, lse)``.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
    )


def flash_attention_cpu_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`flash_attention_cpu` for the given ``out`` and ``lse``: passing those of the
    whole key range (the merged result) gives one key block's exact share of the gradients.

    Returns:
        ``(dq, dk, dv)``.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale
    )


# ---- fused CUDA attention with log-sum-exp (attention_kernels.py) ----------------------------------------
# The three fused kernels behind SDPA on CUDA, as torch's own ring attention calls them
# (torch/distributed/tensor/experimental/_context_parallel/_attention.py). Inputs are (B, H, S, D) with a head
# dim the kernel takes (the caller pads it to a multiple of 8); dropout is never used, so the random-number
# state the backward ops take is a placeholder. Every forward returns ``(out, lse)``, lse fp32 (B, H, Sq).
_EFFICIENT_LSE_ALIGN = 32  # the memory-efficient kernel's lse rows are padded to a multiple of 32 queries


def _no_rng_state(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=like.device)


def flash_attention_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the flash kernel (float16/bfloat16; k/v may have fewer heads: grouped-query attention without
    repeating them). No mask but the causal one (top-left aligned).

    Returns:
        ``(out, lse)``.
    """
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return out, lse


def flash_attention_cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`flash_attention_cuda` for the given ``out`` and ``lse`` (B, H, Sq); lse is made
    contiguous here (a strided lse gives wrong gradients).

    Returns:
        ``(dq, dk, dv)``.
    """
    rng = _no_rng_state(q)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, is_causal, rng, rng, scale=scale
    )
    return dq, dk, dv


def efficient_attention_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the memory-efficient kernel (float32/float16/bfloat16, equal heads).

    ``bias``: additive ``(B, H, Sq, Sk)`` in q's dtype, last dim contiguous, other strides multiples of 16
    elements (an expanded ``(B, 1, 1, Sk_aligned)`` buffer qualifies: stride 0 is a multiple). The kernel's lse
    has its query dim padded to a multiple of 32; it is cut back to ``Sq`` here.

    Returns:
        ``(out, lse)``.
    """
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, is_causal, scale=scale
    )
    return out, lse.narrow(-1, 0, q.shape[2])


def efficient_attention_cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`efficient_attention_cuda` given ``out`` and ``lse`` (B, H, Sq); lse is padded
    back to the kernel's 32-query alignment (its blocks read whole tiles of it), and ``out`` is put in the
    forward's own memory layout.

    Returns:
        ``(dq, dk, dv)``.
    """
    sq = q.shape[2]
    padded = torch.nn.functional.pad(lse, (0, -sq % _EFFICIENT_LSE_ALIGN)).contiguous()
    rng = _no_rng_state(q)
    # out in the layout the forward returns it, (B, S, H, D) in memory: given a (B, H, S, D)-contiguous out (a
    # merged ring output), the 16-bit kernels return wrong dq, dk (seen on an H200, torch 2.11; float32 is right)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, padded, rng, rng, 0.0, [True, True, True, False], is_causal, scale=scale
    )
    return dq, dk, dv


def cudnn_attention_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the cuDNN kernel (float16/bfloat16, equal heads, ``bias`` as for the efficient one); its lse keeps
    a trailing dim of 1 ``(B, H, Sq, 1)``, squeezed here.

    Returns:
        ``(out, lse)``.
    """
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, 0.0, is_causal, False, scale=scale
    )
    return out, lse.squeeze(-1)


def cudnn_attention_cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`cudnn_attention_cuda` given ``out`` and ``lse`` (B, H, Sq)."""
    rng = _no_rng_state(q)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse.contiguous().unsqueeze(-1),
        rng,
        rng,
        bias,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        is_causal,
        scale=scale,
    )
    return dq, dk, dv


# ---- fake tensors (wf_mesh.testing's fake-CUDA harness, the agreement under a fake mode) ------------------
def fake_tensor_mode() -> Any:
    """Make a new ``FakeTensorMode``.

    Returns:
        The mode: tensors made under it have shapes, dtypes and devices (CUDA too, on a CPU-only build) and
        no data; torch's kernels' meta functions compute the outputs.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def fake_store() -> dist.Store:
    """The store of torch's ``fake`` process-group backend (registered too)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def outside_fake_mode() -> Any:
    """Context manager: no fake tensor mode inside (new tensors are real), whatever the caller runs under."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# ---- dispatch modes (wf_mesh.testing.c10d_ops) -----------------------------------------------------------
def dispatch_mode() -> type:
    """The base class of ``__torch_dispatch__`` modes (``TorchDispatchMode``, which CommDebugMode builds on)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# ---- torch.compile (CP attention's compiled path) ------------------------------------------------------
def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name`` (``ProcessGroup.group_name``)."""
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    return _resolve_process_group(GroupName(name))


def constant_at_trace(fn: Any) -> Any:
    """Mark ``fn`` for dynamo: called eagerly while tracing (its arguments Python constants), its result put
    into the graph as a constant (guarded by those arguments).

    Returns:
        ``fn``, marked.
    """
    import torch._dynamo

    return torch._dynamo.assume_constant_result(fn)


def graph_breaks(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, int, list[str]]:
    """``(graphs, graph breaks, reasons)`` of tracing ``fn(*args, **kwargs)`` with dynamo (``torch._dynamo.explain``)."""
    import torch._dynamo

    out = torch._dynamo.explain(fn)(*args, **kwargs)
    return out.graph_count, out.graph_break_count, [str(b.reason) for b in out.break_reasons]


def compile_backend(name: str) -> Any:
    """The registered ``torch.compile`` backend ``name`` as a callable (to wrap it, e.g. to count graphs)."""
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)
