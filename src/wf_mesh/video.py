"""Context-parallel split of video latents ``(B, C, T, H, W)``: time first, then height.

The cp ranks form a ``cp_t x cp_h`` grid (time-major): cp rank ``r`` holds the block
``t in [i*T', (i+1)*T')``, ``h in [j*H', (j+1)*H')``, all of W, where ``i, j = divmod(r, cp_h)``. Its tokens
are that block flattened ``(t h w)``. The GLOBAL sequence is the blocks laid end to end, so the shards are
exactly ``Shard(1)`` of a ``(B, T*H*W, C)`` sequence and a CP gather followed by :meth:`VideoSplit.from_sequence`
restores the latent. Position embeddings ``(T, H, W, D)`` are split with the same plan, token for token::

    split = plan_video_split(latent.shape, cp_size=mesh.size("cp"))
    tokens = split.shard(latent)               # (B, T'*H'*W, C), this rank's block, no collective
    pos = split.shard_positions(pos_emb)       # (T'*H'*W, D), matching tokens
    ...                                        # model on local tokens
    video = split.gather(out_tokens)           # (B, C, T, H, W): one all-gather
"""

from __future__ import annotations

import dataclasses
import math

import torch
from einops import rearrange
from torch.distributed.device_mesh import DeviceMesh

from wf_mesh.attention_plan import CPAttentionPlan, plan_cp_attention
from wf_mesh.context_parallel import GradRule, cp_mesh, gather_sequence, sequence_dtensor
from wf_mesh.mesh import ParallelMesh
from wf_mesh.topology import as_int

__all__ = ["VideoSplit", "plan_video_split"]

_BLOCKS = "b c (nt t) (nh h) w -> b (nt nh t h w) c"
_POS_BLOCKS = "(nt t) (nh h) w d -> (nt nh t h w) d"


@dataclasses.dataclass(frozen=True)
class VideoSplit:
    """A CP plan for latents of temporal/spatial size ``(t, h, w)`` over ``cp_t * cp_h`` ranks."""

    t: int
    h: int
    w: int
    cp_t: int
    cp_h: int

    @property
    def cp_size(self) -> int:
        """The ranks the latent is split over (``cp_t * cp_h``)."""
        return self.cp_t * self.cp_h

    @property
    def local_thw(self) -> tuple[int, int, int]:
        """``(T', H', W)`` of each rank's block."""
        return self.t // self.cp_t, self.h // self.cp_h, self.w

    @property
    def local_tokens(self) -> int:
        """The tokens of one rank's shard (``T' * H' * W``)."""
        t, h, w = self.local_thw
        return t * h * w

    def block(self, cp_rank: int) -> tuple[slice, slice]:
        """The (T, H) index ranges of cp rank ``cp_rank``'s block."""
        lt, lh, _ = self.local_thw
        i, j = divmod(cp_rank, self.cp_h)
        return slice(i * lt, (i + 1) * lt), slice(j * lh, (j + 1) * lh)

    def _check(self, shape: torch.Size, t_dim: int, what: str) -> None:
        if tuple(shape[t_dim : t_dim + 3]) != (self.t, self.h, self.w):
            raise ValueError(f"{what}: expected (T, H, W) = {(self.t, self.h, self.w)}, got shape {tuple(shape)}")

    # ---- single-process views ------------------------------------------------------------------------
    def to_sequence(self, latent: torch.Tensor) -> torch.Tensor:
        """``(B, C, T, H, W)`` -> ``(B, T*H*W, C)`` in block order (the global CP sequence)."""
        self._check(latent.shape, 2, "to_sequence")
        return rearrange(latent, _BLOCKS, nt=self.cp_t, nh=self.cp_h)

    def from_sequence(self, tokens: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_sequence`."""
        lt, lh, _ = self.local_thw
        return rearrange(tokens, "b (nt nh t h w) c -> b c (nt t) (nh h) w", nt=self.cp_t, nh=self.cp_h, t=lt, h=lh)

    def positions_to_sequence(self, pos: torch.Tensor) -> torch.Tensor:
        """Position embeddings ``(T, H, W, D)`` (or ``(T*H*W, D)`` in natural order) -> block order."""
        return rearrange(self._pos_grid(pos), _POS_BLOCKS, nt=self.cp_t, nh=self.cp_h)

    def _pos_grid(self, pos: torch.Tensor) -> torch.Tensor:
        if pos.ndim == 2:
            pos = pos.reshape(self.t, self.h, self.w, pos.shape[-1])
        self._check(pos.shape, 0, "positions")
        return pos

    # ---- CP ------------------------------------------------------------------------------------------
    def shard(
        self, latent: torch.Tensor, *, mesh: DeviceMesh | ParallelMesh | None = None, as_dtensor: bool = False
    ) -> torch.Tensor:
        """This cp rank's tokens ``(B, T'*H'*W, C)``: a slice of the latent, no collective, no full copy.

        Returns:
            The tokens; with ``as_dtensor=True`` a DTensor ``Shard(1)`` of the global ``(B, T*H*W, C)``
            sequence.
        """
        self._check(latent.shape, 2, "shard")
        mesh = self._mesh(mesh)
        ts, hs = self.block(mesh.get_local_rank())
        tokens = rearrange(latent[:, :, ts, hs, :], "b c t h w -> b (t h w) c")
        if not as_dtensor:
            return tokens
        b, c = latent.shape[:2]
        return sequence_dtensor(tokens, 1, (b, self.t * self.h * self.w, c), mesh=mesh)

    def shard_positions(self, pos: torch.Tensor, *, mesh: DeviceMesh | ParallelMesh | None = None) -> torch.Tensor:
        """This cp rank's position embeddings ``(T'*H'*W, D)``, matching :meth:`shard` token for token."""
        ts, hs = self.block(self._mesh(mesh).get_local_rank())
        return rearrange(self._pos_grid(pos)[ts, hs], "t h w d -> (t h w) d")

    def gather(
        self, tokens: torch.Tensor, *, mesh: DeviceMesh | ParallelMesh | None = None, grad: GradRule = "replicate"
    ) -> torch.Tensor:
        """Every rank's tokens -> the full latent ``(B, C, T, H, W)``: one all-gather (see ``gather_sequence``)."""
        full = gather_sequence(tokens, 1, mesh=self._mesh(mesh), grad=grad)
        return self.from_sequence(full)

    def attention_plan(self, *, mesh: DeviceMesh | ParallelMesh | None = None) -> CPAttentionPlan:
        """The cp_attention plan of this split's token order (every rank ``local_tokens`` tokens): one agreement
        exchange (while checks are on); pass it to every attention layer of the step.

        Args:
            mesh: the cp mesh (as for :meth:`shard`).

        Returns:
            The :class:`~wf_mesh.CPAttentionPlan` of the ``T*H*W`` token sequence, ``torch.chunk`` shards.
        """
        self._mesh(mesh)
        return plan_cp_attention(self.t * self.h * self.w, mesh=mesh)

    def _mesh(self, mesh: DeviceMesh | ParallelMesh | None) -> DeviceMesh:
        mesh = cp_mesh(mesh)
        if mesh.size() != self.cp_size:
            raise ValueError(f"this VideoSplit plans {self.cp_size} cp ranks, the mesh has {mesh.size()}")
        return mesh


def plan_video_split(
    shape: torch.Size | tuple[int, ...], cp_size: int, patch_values: tuple[int, int, int] = (1, 2, 2)
) -> VideoSplit:
    """Plan the CP split of a ``(B, C, T, H, W)`` latent over ``cp_size`` ranks: time first, then height.

    Walking T then H with ``remaining = cp_size``: ``g = gcd(size // patch, remaining)`` ranks split that dim
    and ``remaining //= g``; width is never split. Pure: no collective, no global state.

    Returns:
        The plan: the latent's ``(t, h, w)`` and the ranks that split T and H (``cp_t``, ``cp_h``).

    Raises:
        TypeError: a size, ``cp_size`` or patch value that is not an int.
        ValueError: not 5 dims, a size or patch < 1; a factor of ``cp_size`` left for W; or a split dim that
            would not cut into equal blocks of whole patches (it would drop rows: H=5 over 2 ranks).
    """
    if len(shape) != 5:
        raise ValueError(f"plan_video_split expects a (B, C, T, H, W) shape, got {tuple(shape)}")
    sizes = [as_int(f"shape[{i}] ({'BCTHW'[i]})", s, minimum=1) for i, s in enumerate(shape)]
    cp_size = as_int("cp_size", cp_size, minimum=1)
    if len(patch_values) != 3:
        raise ValueError(f"patch_values must be 3 ints (T, H, W), got {tuple(patch_values)}")
    patches = [as_int(f"patch_values[{i}]", p, minimum=1) for i, p in enumerate(patch_values)]
    _, _, t, h, w = sizes
    remaining, splits = cp_size, []
    for name, size, patch in (("T", t, patches[0]), ("H", h, patches[1])):
        g = math.gcd(size // patch, remaining)
        if g > 1 and size % (g * patch):
            raise ValueError(
                f"plan_video_split: {name}={size} over {g} ranks would not give equal blocks of whole {patch}-wide "
                f"patches (each block {size // g}, {size - g * (size // g)} left over); make {name} a multiple "
                f"of {g * patch} or choose another cp_size"
            )
        remaining //= g
        splits.append(g)
    if remaining != 1:
        raise ValueError(
            f"plan_video_split: cannot split (T={t}, H={h}, W={w}) with patch {tuple(patches)} over cp_size="
            f"{cp_size}: a factor {remaining} is left for W, which is never split"
        )
    return VideoSplit(t=t, h=h, w=w, cp_t=splits[0], cp_h=splits[1])
