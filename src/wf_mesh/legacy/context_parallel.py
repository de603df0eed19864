"""Legacy context-parallel functions of ``worldfoundry.core.distributed``, layered on the native API.

They take a ProcessGroup (``None`` = parallelism off: the input comes back as is) where the native API takes
a mesh: :func:`mesh_for_group` turns a group into a 1-D DeviceMesh (the current mesh's cp axis when it is
that group, else one built once per group and forgotten when the mesh is destroyed). ``find_split`` keeps the
original side effect: the temporal share of the CP degree it planned, read as ``wf_mesh.parallel_state.cp_size_t``
(:func:`cp_size_t`). Both live in :data:`state`, the mesh extension ``"legacy.context_parallel"``.
"""

from __future__ import annotations

import dataclasses
import pickle

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from wf_mesh import _compat, agreement, errors, waits
from wf_mesh.collectives import broadcast, pickle_allowed
from wf_mesh.context_parallel import (
    broadcast_shard,
    gather_sequence,
    normalize_dim,
    shard_sequence,
)
from wf_mesh.faults import FaultSequence
from wf_mesh.legacy.errors import LegacyIndivisibleSequenceError
from wf_mesh.mesh import parallel_mesh_or_none, register_extension
from wf_mesh.sizing import split_range
from wf_mesh.topology import as_int
from wf_mesh.video import plan_video_split

__all__ = [
    "broadcast_split_tensor",
    "cat_outputs_cp",
    "cat_outputs_cp_with_grad",
    "cp_size_t",
    "find_split",
    "mesh_for_group",
    "split_inputs_cp",
]


@dataclasses.dataclass
class State:
    """What this module keeps per mesh; a fresh one whenever the mesh is destroyed."""

    group_meshes: dict[str, DeviceMesh] = dataclasses.field(default_factory=dict)  # by group name
    cp_size_t: int | None = None  # set by find_split


state = State()


def _reset(destroy_process_groups: bool) -> None:
    global state
    state = State()  # the meshes over groups it does not own: references only


register_extension("legacy.context_parallel", _reset)


def cp_size_t() -> int | None:
    """The temporal share of the CP degree the last :func:`find_split` planned (``parallel_state.cp_size_t``).

    Returns:
        The ranks that split T, or None: no split planned since the mesh was last destroyed.
    """
    return state.cp_size_t


def mesh_for_group(group: dist.ProcessGroup) -> DeviceMesh:
    """The 1-D DeviceMesh over ``group``.

    Returns:
        The current mesh's ``cp`` axis when ``group`` is its cp group, else a mesh built once per group
        (``DeviceMesh.from_group``) and cached until the mesh is destroyed.
    """
    current = parallel_mesh_or_none()
    if current is not None and group is current.group("cp"):
        return current["cp"]
    name = group.group_name
    if name not in state.group_meshes:
        state.group_meshes[name] = DeviceMesh.from_group(group, agreement.comm_device(group).type)
    return state.group_meshes[name]


def _active(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` if it spans more than one rank, else None (parallelism off: the helpers return their input)."""
    return None if group is None or dist.get_world_size(group) == 1 else group


def _check_divisible(length: int, seq_dim: int, parts: int, what: str) -> None:
    if length % parts:
        raise LegacyIndivisibleSequenceError(
            f"{what}: sequence length {length} (seq_dim={seq_dim}) is not divisible by the cp size {parts}"
        )


def split_inputs_cp(x: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contiguous block of ``x`` along ``seq_dim`` (block r for group rank r); no collective.

    Not idempotent: splitting a split tensor shrinks it again.

    Returns:
        A NEW tensor, never a view of ``x`` (in-place updates of the shard leave ``x`` alone; the native
        ``shard_sequence`` returns a view); ``x`` itself for ``cp_group=None`` or a one-rank group.

    Raises:
        LegacyIndivisibleSequenceError: (an AssertionError and a ValueError) the length does not divide
            evenly (the message names the length, dim and cp size).
    """
    group = _active(cp_group)
    if group is None:
        return x
    mesh = mesh_for_group(group)
    _check_divisible(x.shape[normalize_dim(seq_dim, x.ndim)], seq_dim, mesh.size(), "split_inputs_cp")
    return shard_sequence(x, seq_dim, mesh=mesh).clone(memory_format=torch.contiguous_format)


def _cat(x: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup) -> torch.Tensor:
    try:
        return gather_sequence(x, seq_dim, mesh=mesh_for_group(cp_group), grad="replicate")
    except (ValueError, TypeError, IndexError):  # agreed argument errors, raised on every rank as they are
        raise
    except RuntimeError as e:
        raise RuntimeError("Failed to gather tensors") from e


def cat_outputs_cp(x: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``seq_dim`` in group-rank order; the result carries no gradient.

    Returns:
        The concatenation; ``x`` itself for ``cp_group=None`` or a one-rank group.

    Raises:
        ShapeMismatchError: (a RuntimeError and a ValueError, on every rank) shards whose dtype or other dims
            differ across ranks, or whose lengths are not torch.chunk shards of their sum.
        RuntimeError: ``"Failed to gather tensors"``, chained to the failed collective's error.
    """
    group = _active(cp_group)
    if group is None:
        return x
    return _cat(x.detach(), seq_dim, group)


def cat_outputs_cp_with_grad(x: torch.Tensor, seq_dim: int, cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`cat_outputs_cp` whose result keeps this rank's autograd graph.

    Returns:
        The concatenation; the gradient of ``x`` is this rank's slice of the upstream gradient (no
        collective in backward; ``grad="replicate"``).
    """
    group = _active(cp_group)
    if group is None:
        return x
    return _cat(x, seq_dim, group)


def broadcast_split_tensor(
    tensor: torch.Tensor | None, seq_dim: int, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """Scatter the group's first rank's ``tensor``: every rank gets its CP shard along ``seq_dim``.

    Each rank receives only its shard (a scatter), not the whole tensor. Receivers may pass None.

    Returns:
        This rank's shard; None when the source passes None; ``tensor`` itself for ``process_group=None``
        or a one-rank group.

    Raises:
        LegacyIndivisibleSequenceError: (on every rank) the length does not divide evenly by the group size.
    """
    group = _active(process_group)
    if group is None:
        return tensor
    shard = broadcast_shard(tensor, seq_dim, mesh=mesh_for_group(group), as_dtensor=True)
    if shard is None:
        return None
    assert isinstance(shard, DTensor), "broadcast_shard(as_dtensor=True) gives a DTensor"
    dim = seq_dim % shard.ndim  # broadcast_shard checked the range; its placement is Shard(dim)
    _check_divisible(shard.shape[dim], seq_dim, dist.get_world_size(group), "broadcast_split_tensor")
    return shard.to_local()


def find_split(
    shape_tensor: torch.Size | tuple[int, ...],
    cp_size: int,
    patch_values: tuple[int, int, int] = (1, 2, 2),
    view_factor: int = 1,
) -> torch.Size:
    """Plan the split of a ``(B, C, T, H, W)`` latent over ``cp_size`` ranks, time first
    (:func:`~wf_mesh.plan_video_split` of the per-view latent, T // view_factor), never splitting W (the
    original's rule; the native planner splits W when T and H cannot take the whole cp size).

    Side effect (Megatron-compatible): ``wf_mesh.parallel_state.cp_size_t`` becomes the ranks that split T
    (:func:`cp_size_t`) until the mesh is destroyed (or ``destroy_model_parallel`` is called).

    Returns:
        The per-rank ``(T', H', W)``.

    Raises:
        ValueError: not a 5-D shape, or a size that is not a positive int.
        LegacyIndivisibleSequenceError: (an AssertionError and a ValueError) T does not divide by view_factor.

    >>> find_split((1, 16, 24, 88, 160), 16)
    torch.Size([3, 44, 160])
    """
    if len(shape_tensor) != 5:
        raise ValueError(f"find_split expects a (B, C, T, H, W) shape, got {tuple(shape_tensor)}")
    b, c, t, h, w = shape_tensor
    view_factor = as_int("view_factor", view_factor, minimum=1)
    t = as_int("shape_tensor[2] (T)", t, minimum=1)
    if t % view_factor:
        raise LegacyIndivisibleSequenceError(f"find_split: T={t} is not divisible by view_factor={view_factor}")
    split = plan_video_split((b, c, t // view_factor, h, w), cp_size, patch_values, split_width=False)
    state.cp_size_t = split.cp_t
    return torch.Size(split.local_thw)


# ---- added for wf_mesh.compat.worldfoundry.context_parallel ---------------------------------------------------
__all__ += ["cat_outputs_cp_object_list", "robust_broadcast", "split_inputs_cp_object_list"]


def robust_broadcast(
    tensor: torch.Tensor | None, src: int, pg: dist.ProcessGroup | None = None, is_check_shape: bool = False
) -> torch.Tensor | None:
    """The original's tensor broadcast from global rank ``src`` over ``pg``, on :func:`wf_mesh.broadcast`.

    Receivers may pass None or a tensor of any shape with the source's ndim and dtype (ShapeMismatchError on
    every rank otherwise); every rank, the source included, gets the source's tensor on the group's device
    (the source's tensor may live on any device). ``pg=None`` is the default group; a one-rank group returns
    the tensor moved to its device.

    ``src`` must be the group's first (smallest) rank, the one source the native broadcast has.
    ``is_check_shape`` is accepted and ignored: ndim and dtype are always agreed on.

    Returns:
        The source's tensor on the group's device; without torch.distributed ``tensor`` as is.

    Raises:
        NotImplementedError: (on every rank, as every rank passes the same ``src``) ``src`` is a member
            other than the first.
        ValueError: ``src`` is not a member.
        TypeError: the source passed something else than a tensor.
        ShapeMismatchError: a receiver's tensor differs from the source's in ndim or dtype.
    """
    if not dist.is_initialized():
        return tensor
    group = dist.group.WORLD if pg is None else pg
    ranks = dist.get_process_group_ranks(group)
    src = as_int("robust_broadcast: src", src, minimum=0)
    if src not in ranks:
        raise ValueError(f"robust_broadcast: src={src} is not a rank of the group {ranks}")
    if src != ranks[0]:
        raise NotImplementedError(
            f"robust_broadcast: src={src} is not the group's first rank {ranks[0]} (group {ranks}); wf_mesh "
            "broadcasts from a group's first rank only: pass a group whose smallest rank is the source"
        )
    out = broadcast(tensor, group)
    if not isinstance(out, torch.Tensor):  # the same verdict on every rank: receivers got the source's type
        raise TypeError(f"robust_broadcast sends a tensor; the source (rank {src}) passed {type(out).__name__}")
    return out.to(agreement.comm_device(group))


def split_inputs_cp_object_list(object_list: list, cp_group: dist.ProcessGroup | None = None) -> list:
    """This rank's contiguous block of a Python list (block r for group rank r); no collective.

    Any length works: with ``n`` items on ``k`` ranks, the first ``n % k`` ranks get ``n // k + 1`` items and the
    others ``n // k`` (ranks past the end get an empty list), so :func:`cat_outputs_cp_object_list` puts the
    list back together in order. A divisible length gives the original's equal blocks.

    Returns:
        A slice of ``object_list`` (same sequence type); ``object_list`` itself for ``cp_group=None`` or a
        one-rank group.

    Raises:
        ValueError: this rank is not a member of ``cp_group``.
    """
    group = _active(cp_group)
    if group is None:
        return object_list
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"split_inputs_cp_object_list: rank {dist.get_rank()} is not a member of cp_group")
    start, stop = split_range(len(object_list), dist.get_world_size(group), rank)
    return object_list[start:stop]


@dataclasses.dataclass(frozen=True)
class _ObjectListFacts(agreement.Facts):
    length: int = agreement.fact(label="list length")  # may differ: validation only, every rank passed a list
    pickled_bytes: int = 0
    """The length of this rank's pickled list (the all-gather pads every rank's to the longest)."""
    pickled: bytes = agreement.fact(local=True, default=b"")


def cat_outputs_cp_object_list(
    object_list: list, cp_group: dist.ProcessGroup | None = None, *, allow_pickle: bool | None = None
) -> list:
    """Every rank's list concatenated in group-rank order (ranks may hold different lengths, also zero).

    The items travel pickled, so every rank must allow pickle (``allow_pickle``, default the environment's
    ``WF_MESH_ALLOW_PICKLE``). Each rank pickles its list while it validates, so the agreement carries the
    pickles' sizes: then one all-gather of the pickles padded to the longest (``all_gather_object`` takes
    two). Contained (:mod:`wf_mesh.faults`): the copy into the send buffer and the unpickling of the parts.

    Returns:
        The concatenated list; ``object_list`` itself for ``cp_group=None`` or a one-rank group.

    Raises:
        TypeError: (on every rank, before any data moves) a rank refuses pickle, passed something else than a
            list or tuple, or holds an item pickle cannot take.
        RuntimeError: ``"Failed to gather objects"``, chained to the failed all-gather's error.
        CollectiveTimeoutError: (a RuntimeError too) a peer did not answer within the group's timeout.
    """
    group = _active(cp_group)
    if group is None:
        return object_list
    pickle_ok = pickle_allowed(allow_pickle)

    def facts() -> _ObjectListFacts:
        if not isinstance(object_list, (list, tuple)):
            raise TypeError(f"object_list must be a list or tuple, got {type(object_list).__name__}")
        if not pickle_ok:
            raise TypeError(
                "the objects travel pickled and pickle is off on this rank (allow_pickle=False or "
                "WF_MESH_ALLOW_PICKLE=0)"
            )
        try:
            pickled = pickle.dumps(list(object_list))
        except Exception as exc:
            raise TypeError(f"cannot pickle this rank's objects: {type(exc).__name__}: {exc}") from None
        return _ObjectListFacts(length=len(object_list), pickled_bytes=len(pickled), pickled=pickled)

    what = "cat_outputs_cp_object_list"
    agreed = agreement.agree(group, facts, what=what, required=True)
    sizes = agreed.values("pickled_bytes")
    width, index, device = max(sizes), dist.get_rank(group), agreement.comm_device(group)
    received = torch.empty(len(sizes) * width, dtype=torch.uint8, device=device)
    seq = FaultSequence(group, what)
    send = seq.step(("copy-in", 1, 1), _padded_pickle, agreed.mine.pickled, width, device)
    if send is None:  # the peers still expect this rank's part: send the buffer already held, marked failed
        send = received[index * width : (index + 1) * width]
        send[0] = _FAILED
    try:
        with waits.bounded(group, what):
            _compat.all_gather_single(received, send, group=group)
    except errors.CollectiveTimeoutError:
        raise
    except RuntimeError as e:
        raise RuntimeError("Failed to gather objects") from e
    parts = seq.step(("unpickle", 1, 1), _unpickled_parts, received, sizes, width)
    seq.close()
    return [item for part in parts for item in part]


def _padded_pickle(pickled: bytes, width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(width, dtype=torch.uint8)
    out[: len(pickled)] = torch.frombuffer(bytearray(pickled), dtype=torch.uint8)
    return out.to(device)


_FAILED = 0
"""The first byte of the part a rank whose copy-in failed sends (a pickle starts with its PROTO opcode, 0x80)."""


def _unpickled_parts(received: torch.Tensor, sizes: list[int], width: int) -> list[list]:
    """Each rank's list; a failed rank's part is left out (its verdict comes at the close)."""
    data = received.cpu().numpy().tobytes()
    parts = [data[r * width : r * width + n] for r, n in enumerate(sizes)]
    return [pickle.loads(part) for part in parts if part[0] != _FAILED]
