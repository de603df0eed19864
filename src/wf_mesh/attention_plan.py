"""One CP-attention plan per model step: every rank's shard length, agreed once, reused by every layer.

``cp_attention`` on plain tensors must learn every rank's shard length from its peers: one agreement
exchange (an all-gather and a host sync) per call, i.e. per attention layer. The layers of one step all
attend over the same sequence, so :func:`plan_cp_attention` agrees on it once::

    plan = wf_mesh.plan_cp_attention(seq_len=tokens_global, mesh=pm, balance="zigzag")
    for block in blocks:
        x = block(x, plan=plan)        # cp_attention(..., plan=plan): data collectives only

A :class:`CPAttentionPlan` holds what the call needs beyond its own tensors: the cp mesh, every rank's shard
length and the balance, and (on a mesh with them) the ``cp_ring`` / ``cp_ulysses`` axes of ``method="usp"``.
With it, ``cp_attention`` derives its method plan by arithmetic alone: no agreement, no host sync, checks on
or off. What the call can check on this rank still raises (a local shard that contradicts the plan, names
both); what only peers could tell (another rank's different call) is the plan's agreement's job, done once.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.device_mesh import DeviceMesh

from wf_mesh import _compat
from wf_mesh.agreement import Facts, agree, fact
from wf_mesh.attention_ops import rank_segments
from wf_mesh.context_parallel import cp_mesh
from wf_mesh.errors import ShapeMismatchError
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh, parallel_mesh_or_none, register_extension
from wf_mesh.topology import as_int

__all__ = ["CPAttentionPlan", "plan_cp_attention"]

METHODS = ("ring", "ulysses", "usp", "allgather")
BALANCES = (None, "zigzag")
USP_DIMS = ("cp_ring", "cp_ulysses")

MeshArg = DeviceMesh | ParallelMesh | None


# ---- meshes --------------------------------------------------------------------------------------------
def cp_of(mesh: MeshArg) -> DeviceMesh:
    """The cp mesh of ``mesh``.

    Returns:
        The 1-D mesh over all cp ranks in cp-rank order; a 2-D ``("cp_ring", "cp_ulysses")`` mesh is flattened
        (its process group is created once, on the first call, collectively over the mesh's root).

    Raises:
        ValueError: a 2-D mesh not named ``("cp_ring", "cp_ulysses")``.
    """
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
        if mesh.mesh_dim_names != USP_DIMS:
            raise ValueError(f"cp_attention: a 2-D mesh must have mesh_dim_names {USP_DIMS}, got {mesh.mesh_dim_names}")
        return _compat.flatten(mesh, "_".join(USP_DIMS))
    return cp_mesh(mesh)


def usp_axes(mesh: MeshArg) -> tuple[DeviceMesh, DeviceMesh]:
    """``(cp_ring, cp_ulysses)`` 1-D meshes of this rank."""
    if mesh is None:
        mesh = get_parallel_mesh()
    if isinstance(mesh, ParallelMesh):
        try:
            return mesh["cp_ring"], mesh["cp_ulysses"]
        except KeyError:
            raise ValueError(
                f"method='usp' needs 'cp_ring' and 'cp_ulysses' axes; this ParallelMesh has {list(mesh.axes)} "
                "(build it with ParallelDims(cp=..., cp_ulysses=...), or pass a 2-D DeviceMesh named "
                f"{USP_DIMS})"
            ) from None
    if mesh.ndim == 2 and mesh.mesh_dim_names == USP_DIMS:
        return mesh["cp_ring"], mesh["cp_ulysses"]
    raise ValueError(
        f"method='usp' needs a ParallelMesh with 'cp_ring' and 'cp_ulysses' axes or a 2-D DeviceMesh named "
        f"{USP_DIMS}, got a {mesh.ndim}-D mesh named {mesh.mesh_dim_names}"
    )


def _usp_axes_or_none(mesh: MeshArg) -> tuple[DeviceMesh, DeviceMesh] | None:
    if mesh is None:
        mesh = get_parallel_mesh()
    if isinstance(mesh, ParallelMesh):
        has = "cp_ring" in mesh and "cp_ulysses" in mesh
    else:
        has = mesh.ndim == 2 and mesh.mesh_dim_names == USP_DIMS
    return usp_axes(mesh) if has else None


def shard_lengths(seq_len: int, parts: int, balance: str | None) -> tuple[int, ...]:
    """Every cp rank's shard length: ``torch.chunk`` sizes, or the zigzag layout's."""
    return tuple(sum(s.length for s in segments) for segments in rank_segments(seq_len, parts, balance))


# ---- the plan ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class CPAttentionPlan:
    """Every cp rank's shard of one sequence, for the cp_attention calls of one model step.

    Build it with :func:`plan_cp_attention` (or :meth:`wf_mesh.VideoSplit.attention_plan`); pass it as
    ``plan=`` to :func:`~wf_mesh.cp_attention` or :class:`~wf_mesh.CPSelfAttention`.
    """

    seq_len: int
    """The global sequence length."""
    balance: str | None
    """None (``torch.chunk`` shards) or ``"zigzag"``."""
    lengths: tuple[int, ...]
    """Every cp rank's shard length, in cp-rank order."""
    mesh: DeviceMesh
    """The 1-D cp mesh (a ``(cp_ring, cp_ulysses)`` mesh flattened, cp rank = ring * U + ulysses)."""
    usp_axes: tuple[DeviceMesh, DeviceMesh] | None
    """``(cp_ring, cp_ulysses)`` for ``method="usp"``; None on a mesh without them."""
    source: MeshArg = None
    """The ``mesh`` argument the plan was built from (cp_attention accepts it, or None, as its ``mesh``)."""
    rank: int = 0
    """This rank's cp rank."""
    key: str = ""
    """The plan's contents as a string (groups by name): what a compiled graph is specialized on, so that
    equal plans of later steps reuse it."""

    @property
    def local_len(self) -> int:
        """This rank's shard length."""
        return self.lengths[self.rank]

    def check_local_len(self, local_len: int, what: str = "cp_attention") -> None:
        """Raise ShapeMismatchError (on this rank) unless ``local_len`` is this rank's planned shard length."""
        if local_len != self.lengths[self.rank]:
            raise ShapeMismatchError(
                f"{what}: this rank's shard holds {local_len} tokens but the plan gives cp rank {self.rank} "
                f"{self.lengths[self.rank]} (seq_len={self.seq_len}, balance={self.balance!r}, shard lengths "
                f"{list(self.lengths)})"
            )


@dataclasses.dataclass(frozen=True)
class _PlanFacts(Facts):
    seq_len: int
    balance: str | None = fact(choices=BALANCES)
    cp: int = fact(label="cp size")
    usp: tuple[int, ...] = fact(label="(cp_ring, cp_ulysses)")
    plan: CPAttentionPlan | None = fact(local=True, default=None)


def plan_cp_attention(seq_len: int, *, mesh: MeshArg = None, balance: str | None = None) -> CPAttentionPlan:
    """Plan the cp_attention calls over one sequence: agreed once, then reused by every layer of the step.

    One agreement exchange (when checks are on, see :func:`wf_mesh.agreement.checks_enabled`; it only
    validates: every rank computes the lengths from ``seq_len``) checks that every rank plans the same
    sequence; a ``cp_attention(..., plan=plan)`` call then issues its data collectives only.

    Args:
        seq_len: the global sequence length (the sum of every rank's shard).
        mesh: a ParallelMesh (its ``cp`` axis, and its ``cp_ring`` / ``cp_ulysses`` axes if it has them), a 1-D
            cp DeviceMesh, a 2-D DeviceMesh named ``("cp_ring", "cp_ulysses")``, or None: the current
            ParallelMesh.
        balance: None (``torch.chunk`` shards) or ``"zigzag"`` (shards from :func:`~wf_mesh.zigzag_shard`).

    Returns:
        The plan: every rank's shard length, the balance, the cp mesh and its usp axes.

    Raises:
        TypeError, ValueError: a ``seq_len`` that is not an int >= 1, an unknown balance, a bad mesh (on
            every rank when checks are on).
        DisagreementError: ranks that plan different ``seq_len``, balance or mesh sizes.
    """
    cp = cp_of(mesh)

    def facts() -> _PlanFacts:
        length = as_int("seq_len", seq_len, minimum=1)
        if balance not in BALANCES:
            raise ValueError(f"balance={balance!r}: use None or 'zigzag'")
        axes = _usp_axes_or_none(mesh)
        sizes = () if axes is None else (axes[0].size(), axes[1].size())
        return _PlanFacts(length, balance, cp.size(), sizes, plan=_build(length, balance, cp, axes, mesh))

    agreed = agree(cp.get_group(), facts, what="plan_cp_attention")
    for name in ("seq_len", "balance", "cp", "usp"):
        agreed.require_same(name)
    plan = agreed.mine.plan
    assert plan is not None
    _PLANS[plan.key] = plan
    return plan


def _build(seq_len: int, balance: str | None, cp: DeviceMesh, axes, source: MeshArg) -> CPAttentionPlan:
    lengths = shard_lengths(seq_len, cp.size(), balance)
    groups = [m.get_group().group_name for m in (cp, *(axes or ()))]
    key = repr((groups, lengths, balance, cp.get_local_rank()))
    return CPAttentionPlan(seq_len, balance, lengths, cp, axes, source, cp.get_local_rank(), key)


def dtensor_plan(mesh: DeviceMesh, seq_len: int) -> CPAttentionPlan:
    """The plan DTensor inputs on the 1-D cp ``mesh`` with global length ``seq_len`` imply (``torch.chunk``
    shards; usp axes of the current ParallelMesh, if it has them): no exchange.

    Returns:
        The plan, registered like a built one.
    """
    plan = _build(seq_len, None, mesh, _usp_axes_or_none(None) if parallel_mesh_or_none() else None, None)
    _PLANS[plan.key] = plan
    return plan


_PLANS: dict[str, CPAttentionPlan] = {}
"""The latest plan of each key (cp_attention's compiled path finds its plan by key)."""


def _forget_plans(destroy_process_groups: bool) -> None:
    """The mesh is going away: forget its plans (they hold its meshes and groups; a plan of a destroyed mesh
    cannot run). Compiled graphs do not read them (only tracing does)."""
    _PLANS.clear()


register_extension("attention_plan", _forget_plans)


def planned(key: str) -> CPAttentionPlan:
    """The latest plan built with ``key``."""
    try:
        return _PLANS[key]
    except KeyError:
        raise ValueError(f"no CPAttentionPlan with key {key!r} was built in this process") from None
