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

**Masks** (:class:`~wf_mesh.RangeMask`: block-causal frame chunks, packed clips, chunk windows). With
``mask=`` the plan decides which tokens each rank holds so that every rank computes about the same number of
unmasked (query, key) pairs (:mod:`wf_mesh.load_balance`: whole chunks by greedy LPT, the heaviest cut until
``plan.imbalance <= 1.10``)::

    mask = wf_mesh.RangeMask.block_causal([tokens_per_chunk] * chunks)
    plan = wf_mesh.plan_cp_attention(mask=mask, mesh=pm)     # balance="work": the balanced layout
    local = plan.shard(x, 1)                                  # this rank's tokens, plan order, no collective
    y = plan.gather(model(local), 1)                          # the global order again (autograd-aware)

``plan.segments`` says which global intervals each rank holds. ``cp_attention(q, k, v, plan=plan)`` on
these shards evaluates the mask from global positions (:mod:`wf_mesh.attention`); ``plan.ring_skips()``
counts the blocks, K/V hops and dK/dV messages a ring over it skips.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from wf_mesh import _compat
from wf_mesh.agreement import Facts, agree, fact
from wf_mesh.attention_ops import RingSkips, rank_segments, ring_needs
from wf_mesh.context_parallel import GradRule, cp_mesh, gather_sequence, normalize_dim
from wf_mesh.errors import ShapeMismatchError
from wf_mesh.load_balance import balance_by_work, coalesce, imbalance, rank_work
from wf_mesh.masks import RangeMask
from wf_mesh.mesh import ParallelMesh, get_parallel_mesh, parallel_mesh_or_none, register_extension
from wf_mesh.topology import as_int

__all__ = ["CPAttentionPlan", "plan_cp_attention"]

METHODS = ("ring", "ulysses", "usp", "allgather")
BALANCES = (None, "zigzag")
"""The layouts cp_attention computes (a plan without a mask)."""
MASK_BALANCES = (None, "zigzag", "work")
"""The layouts of a plan with a mask: ``"work"`` balances the mask's unmasked pairs (the default there)."""
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
    mask: RangeMask | None = None
    """The mask the plan was balanced for (None: no mask)."""
    segments: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per cp rank, the global intervals ``(start, end)`` its shard holds, in plan order (increasing)."""
    work: tuple[int, ...] = ()
    """Per cp rank, the unmasked (query, key) pairs of its queries (no mask: full attention's)."""
    _orders: dict[torch.device, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)
    """Per device, the index that puts :meth:`gather`'s padded all-gather in global order (built once)."""

    @property
    def local_len(self) -> int:
        """This rank's shard length."""
        return self.lengths[self.rank]

    @property
    def imbalance(self) -> float:
        """``max / mean`` of :attr:`work` over the ranks (1.0 when nothing attends)."""
        return imbalance(self.work)

    def check_local_len(self, local_len: int, what: str = "cp_attention") -> None:
        """Raise ShapeMismatchError (on this rank) unless ``local_len`` is this rank's planned shard length.

        Raises:
            ShapeMismatchError: another length.
        """
        if local_len != self.lengths[self.rank]:
            raise ShapeMismatchError(
                f"{what}: this rank's shard holds {local_len} tokens but the plan gives cp rank {self.rank} "
                f"{self.lengths[self.rank]} (seq_len={self.seq_len}, balance={self.balance!r}, shard lengths "
                f"{list(self.lengths)})"
            )

    def ring_skips(self, ring_size: int | None = None) -> RingSkips:
        """What a ring over this plan's mask skips (blocks not computed, K/V hops and dK/dV messages not sent),
        summed over the ring ranks: ``ring_size`` ranks (default: the cp size, method ``"ring"``; usp: the
        ``cp_ring`` size), each holding the shards of ``cp / ring_size`` consecutive cp ranks.

        Returns:
            The counts (a plan without a mask skips only empty blocks).

        Raises:
            ValueError: a ``ring_size`` that does not divide the cp size.
        """
        n = len(self.lengths)
        size = n if ring_size is None else as_int("ring_size", ring_size, minimum=1)
        if n % size:
            raise ValueError(f"ring_size={size} does not divide the cp size {n}")
        u = n // size
        blocks = [[iv for r in range(i * u, (i + 1) * u) for iv in self.segments[r]] for i in range(size)]
        if self.mask is None:
            needs = [[bool(q) and bool(kv) for kv in blocks] for q in blocks]
        else:
            needs = ring_needs(self.mask, blocks)
        return RingSkips.of(needs)

    def shard(self, x: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """This rank's tokens of the global ``x``: its :attr:`segments` along ``seq_dim``, in plan order.

        No collective (a view for one interval, one copy for several); gradients flow back to ``x``.

        Args:
            x: the global tensor (plain), ``seq_len`` long along ``seq_dim``.
            seq_dim: the sequence dim.

        Returns:
            This rank's shard, :attr:`local_len` long along ``seq_dim``.

        Raises:
            TypeError: ``x`` is a DTensor or not a tensor.
            ShapeMismatchError: ``x`` is not ``seq_len`` long along ``seq_dim``.
        """
        dim = self._plain_dim(x, seq_dim, "shard")
        if x.shape[dim] != self.seq_len:
            raise ShapeMismatchError(
                f"plan.shard: x holds {x.shape[dim]} tokens along dim {dim}, the plan's seq_len is {self.seq_len}"
            )
        parts = [x.narrow(dim, a, b - a) for a, b in self.segments[self.rank]]
        if not parts:
            return x.narrow(dim, 0, 0)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def gather(self, y: torch.Tensor, seq_dim: int, *, grad: GradRule = "replicate") -> torch.Tensor:
        """The global tensor from every rank's shard (the inverse of :meth:`shard`), in global order.

        One :func:`~wf_mesh.gather_sequence` of the shards padded to the longest, then one ``index_select``
        with an index built once per plan and device: exact, and autograd-aware as ``gather_sequence`` is
        (``grad`` chooses its backward rule).

        Args:
            y: this rank's shard (plain), :attr:`local_len` long along ``seq_dim``.
            seq_dim: the sequence dim.
            grad: ``"replicate"`` (every rank computes the same loss from the result) or ``"partial"``.

        Returns:
            The global tensor on every rank.

        Raises:
            TypeError: ``y`` is a DTensor or not a tensor.
            ShapeMismatchError: a shard that is not its rank's planned length (on every rank when checks are
                on), or shards that disagree on dtype or the other dims.
        """
        dim = self._plain_dim(y, seq_dim, "gather")
        local, longest, parts = y.shape[dim], max(self.lengths), len(self.lengths)
        if local != self.local_len:  # sent so that gather_sequence refuses it on every rank: not `longest` long
            padded = y if local != longest else y.narrow(dim, 0, 0)
        elif local == longest:
            padded = y
        else:
            shape = list(y.shape)
            shape[dim] = longest - local
            padded = torch.cat([y, y.new_zeros(shape)], dim)
        try:
            full = gather_sequence(padded, dim, mesh=self.mesh, seq_len=longest * parts, grad=grad)
        except ShapeMismatchError as exc:
            mine = (
                f"this rank's shard holds {local} tokens along dim {dim} but the plan gives cp rank {self.rank} "
                f"{self.local_len}"
                if local != self.local_len
                else "another rank's shard does not fit the plan"
            )
            raise ShapeMismatchError(f"plan.gather: {mine} (shard lengths {list(self.lengths)}): {exc}") from exc
        if all(len(s) <= 1 for s in self.segments) and all(n == longest for n in self.lengths):
            return full  # contiguous even shards: already in global order
        return full.index_select(dim, self._order(full.device))

    def _plain_dim(self, x: object, seq_dim: int, what: str) -> int:
        if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
            raise TypeError(f"plan.{what} takes a plain torch.Tensor, got {type(x).__name__}")
        return normalize_dim(seq_dim, x.ndim)

    def _order(self, device: torch.device) -> torch.Tensor:
        """Where each global position lies in the padded all-gather (rank r's shard at ``r * longest``)."""
        order = self._orders.get(device)
        if order is None:
            longest = max(self.lengths)
            spans = []
            for rank, segs in enumerate(self.segments):
                offset = rank * longest
                for a, b in segs:
                    spans.append((a, offset, b - a))
                    offset += b - a
            order = torch.cat([torch.arange(o, o + n, dtype=torch.long) for _, o, n in sorted(spans)]).to(device)
            self._orders[device] = order
        return order


@dataclasses.dataclass(frozen=True)
class _PlanFacts(Facts):
    seq_len: int
    balance: str | None = fact(choices=MASK_BALANCES)
    cp: int = fact(label="cp size")
    usp: tuple[int, ...] = fact(label="(cp_ring, cp_ulysses)")
    mask: tuple[int, ...] | None = fact(label="mask (pieces, digest)")
    plan: CPAttentionPlan | None = fact(local=True, default=None)


def plan_cp_attention(
    seq_len: int | None = None,
    *,
    mesh: MeshArg = None,
    balance: str | None = "auto",
    mask: RangeMask | None = None,
) -> CPAttentionPlan:
    """Plan the cp_attention calls over one sequence: agreed once, then reused by every layer of the step.

    One agreement exchange (when checks are on, see :func:`wf_mesh.agreement.checks_enabled`; it only
    validates: every rank computes the plan from the same arguments) checks that every rank plans the same
    sequence; a ``cp_attention(..., plan=plan)`` call then issues its data collectives only.

    Args:
        seq_len: the global sequence length (the sum of every rank's shard); implied by ``mask``.
        mesh: a ParallelMesh (its ``cp`` axis, and its ``cp_ring`` / ``cp_ulysses`` axes if it has them), a 1-D
            cp DeviceMesh, a 2-D DeviceMesh named ``("cp_ring", "cp_ulysses")``, or None: the current
            ParallelMesh.
        balance: None (``torch.chunk`` shards), ``"zigzag"`` (shards from :func:`~wf_mesh.zigzag_shard`), or
            with a mask ``"work"`` (:func:`wf_mesh.load_balance.balance_by_work`); ``"auto"``: ``"work"`` with a
            mask, else None.
        mask: a :class:`~wf_mesh.RangeMask`: the plan balances its unmasked pairs over the ranks
            (:attr:`CPAttentionPlan.imbalance`); ``cp_attention(..., plan=plan)`` evaluates it.

    Returns:
        The plan: every rank's shard length and segments, the balance, the cp mesh and its usp axes.

    Raises:
        TypeError, ValueError: a ``seq_len`` that is not an int >= 1 (or not the mask's), neither ``seq_len``
            nor ``mask``, a mask that is not a RangeMask, an unknown balance, a bad mesh (on every rank when
            checks are on).
        DisagreementError: ranks that plan different ``seq_len``, balance, mask or mesh sizes.
    """
    cp = cp_of(mesh)

    def facts() -> _PlanFacts:
        if mask is not None and not isinstance(mask, RangeMask):
            raise TypeError(f"mask must be a wf_mesh.RangeMask, got {type(mask).__name__}")
        if seq_len is not None:
            length = as_int("seq_len", seq_len, minimum=1)
        elif mask is not None:
            length = mask.seq_len
        else:
            raise TypeError("plan_cp_attention needs seq_len or mask")
        if mask is not None and length != mask.seq_len:
            raise ValueError(f"seq_len={length} contradicts the mask's seq_len {mask.seq_len}")
        chosen = _balance(balance, mask)
        axes = _usp_axes_or_none(mesh)
        sizes = () if axes is None else (axes[0].size(), axes[1].size())
        summary = None if mask is None else (len(mask.pieces), mask.digest())
        plan = _build(length, chosen, cp, axes, mesh, mask)
        return _PlanFacts(length, chosen, cp.size(), sizes, summary, plan=plan)

    agreed = agree(cp.get_group(), facts, what="plan_cp_attention")
    for name in ("seq_len", "balance", "cp", "usp", "mask"):
        agreed.require_same(name)
    plan = agreed.mine.plan
    assert plan is not None
    _PLANS[plan.key] = plan
    return plan


def _balance(balance: str | None, mask: RangeMask | None) -> str | None:
    """The layout ``balance`` names for a plan with or without ``mask``."""
    if balance == "auto":
        return "work" if mask is not None else None
    if mask is None and balance not in BALANCES:
        hint = " (balance='work' balances a mask: pass mask=)" if balance == "work" else ""
        raise ValueError(f"balance={balance!r}: use None or 'zigzag'{hint}")
    if balance not in MASK_BALANCES:
        raise ValueError(f"balance={balance!r}: with a mask use 'work', None or 'zigzag'")
    return balance


@functools.lru_cache(maxsize=16)
def _mask_segments(mask: RangeMask, parts: int, balance: str | None) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each rank's intervals under ``mask`` (cached: a training loop plans the same mask every step)."""
    if balance == "work":
        return tuple(tuple(segs) for segs in balance_by_work(mask, parts))
    return _layout_segments(mask.seq_len, parts, balance)


def _layout_segments(seq_len: int, parts: int, balance: str | None) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each rank's global intervals of the ``torch.chunk`` or zigzag layout, in its shard's order."""
    return tuple(
        tuple(coalesce([(s.start, s.start + s.length) for s in segs]))
        for segs in rank_segments(seq_len, parts, balance)
    )


def _build(
    seq_len: int, balance: str | None, cp: DeviceMesh, axes, source: MeshArg, mask: RangeMask | None = None
) -> CPAttentionPlan:
    parts = cp.size()
    if mask is None:
        segments = _layout_segments(seq_len, parts, balance)
        lengths = shard_lengths(seq_len, parts, balance)
        work = tuple(n * seq_len for n in lengths)
    else:
        segments = _mask_segments(mask, parts, balance)
        lengths = tuple(sum(b - a for a, b in segs) for segs in segments)
        work = tuple(rank_work(mask, segments))
    groups = [m.get_group().group_name for m in (cp, *(axes or ()))]
    digest = None if mask is None else mask.digest()
    key = repr((groups, lengths, balance, cp.get_local_rank(), digest))
    return CPAttentionPlan(seq_len, balance, lengths, cp, axes, source, cp.get_local_rank(), key, mask, segments, work)


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
