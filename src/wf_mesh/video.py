"""Context-parallel split of video latents ``(B, C, T, H, W)`` and of their patch tokens: time, then height,
then width.

The cp ranks form a ``cp_t x cp_h x cp_w`` grid, time slowest and width fastest: cp rank
``r = (i * cp_h + j) * cp_w + k`` holds block ``(i, j, k)``, the frames ``[i*T', (i+1)*T')``, rows
``[j*H', (j+1)*H')`` and columns ``[k*W', (k+1)*W')``. Width is split only when time and height cannot take
the whole cp size (``cp_w = 1`` otherwise: a block holds all of W).

**Token order, the one rule.** A rank's shard holds the tokens of ITS block in natural ``(t h w)`` order
(t slowest, w fastest: the block's own grid flattened). Laid end to end in cp-rank order the shards form the
*block-order* global sequence, which is what cp_attention and ``gather_sequence`` see: the shards are exactly
``Shard(1)`` of it (equal blocks, so ``torch.chunk`` sizing). The gathers return the natural order of the whole
video again. Two grids follow the rule:

- the **latent grid** ``(T, H, W)``, every voxel a token: :meth:`VideoSplit.shard` / :meth:`~VideoSplit.gather`
  take and return the latent, :meth:`~VideoSplit.shard_positions` splits a ``(T, H, W, D)`` table;
- the **token grid** ``(T/pt, H/ph, W/pw)`` of a patch embedding with patch ``(pt, ph, pw)``
  (``plan_video_split(..., patch_values=...)``; blocks are whole patches): :meth:`~VideoSplit.shard_tokens`
  takes ``(B, N, D)`` tokens in natural ``(t h w)`` order AFTER the patch embedding, :meth:`~VideoSplit.positions`
  gives every local token's global ``(t, h, w)`` index (for any RoPE), :meth:`~VideoSplit.gather_tokens`
  returns ``(B, N, D)`` in natural order.

Latent recipe::

    split = plan_video_split(latent.shape, cp_size=mesh.size("cp"))
    tokens = split.shard(latent)               # (B, T'*H'*W', C), this rank's block, no collective
    pos = split.shard_positions(pos_emb)       # (T'*H'*W', D), matching tokens
    ...                                        # model on local tokens
    video = split.gather(out_tokens)           # (B, C, T, H, W): one all-gather

Token recipe (a Conv3d patch embedding and a 3-D RoPE inside the model)::

    split = plan_video_split(latent.shape, cp_size=mesh.size("cp"), patch_values=(1, 2, 2))
    tokens = patch_embed(latent).flatten(2).transpose(1, 2)   # (B, N, D), natural (t h w) order, every rank
    tokens = split.shard_tokens(tokens)                       # this rank's block, no collective
    cos, sin = rope(split.positions())                        # (N_local, 3) global (t, h, w) indices
    ...                                                       # blocks with cp_attention on local tokens
    out = split.gather_tokens(final_layer(tokens))            # (B, N, D'), natural order: unpatchify as before
"""

from __future__ import annotations

import dataclasses
import math

import torch
from einops import rearrange
from torch.distributed.device_mesh import DeviceMesh

from wf_mesh import agreement
from wf_mesh.attention_plan import CPAttentionPlan, plan_cp_attention
from wf_mesh.context_parallel import GradRule, cp_mesh, gather_sequence, normalize_dim, sequence_dtensor
from wf_mesh.mesh import ParallelMesh
from wf_mesh.topology import as_int

__all__ = ["VideoSplit", "plan_video_split"]

_BLOCKS = "b c (nt t) (nh h) (nw w) -> b (nt nh nw t h w) c"
_POS_BLOCKS = "(nt t) (nh h) (nw w) d -> (nt nh nw t h w) d"
_DIMS = "THW"


@dataclasses.dataclass(frozen=True)
class VideoSplit:
    """A CP plan for latents of temporal/spatial size ``(t, h, w)`` over ``cp_t * cp_h * cp_w`` ranks.

    ``patch`` is the patch size ``(pt, ph, pw)`` of the model's patch embedding (the blocks are whole patches):
    it defines the token grid of :meth:`shard_tokens` / :meth:`positions` / :meth:`gather_tokens`. Token order:
    see the module docstring (each shard natural ``(t h w)`` within its block; gathers natural order).
    """

    t: int
    h: int
    w: int
    cp_t: int
    cp_h: int
    cp_w: int = 1
    patch: tuple[int, int, int] = (1, 1, 1)

    @property
    def cp_size(self) -> int:
        """The ranks the latent is split over (``cp_t * cp_h * cp_w``)."""
        return self.cp_t * self.cp_h * self.cp_w

    @property
    def local_thw(self) -> tuple[int, int, int]:
        """``(T', H', W')`` of each rank's block of the latent (``W' = W`` unless width is split)."""
        return self.t // self.cp_t, self.h // self.cp_h, self.w // self.cp_w

    @property
    def local_tokens(self) -> int:
        """The latent positions of one rank's shard (``T' * H' * W'``)."""
        return math.prod(self.local_thw)

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """The patch-token grid ``(T/pt, H/ph, W/pw)`` of the whole video.

        Raises:
            ValueError: a size that is not a multiple of its patch (the grid is not whole patches).
        """
        for name, size, patch in zip(_DIMS, (self.t, self.h, self.w), self.patch):
            if size % patch:
                raise ValueError(
                    f"VideoSplit: {name}={size} is not a multiple of its patch {patch} (patch {self.patch}): the "
                    "latent has no whole token grid"
                )
        return self.t // self.patch[0], self.h // self.patch[1], self.w // self.patch[2]

    @property
    def local_token_grid(self) -> tuple[int, int, int]:
        """``(T', H', W')`` of each rank's block of the token grid."""
        t, h, w = self.token_grid
        return t // self.cp_t, h // self.cp_h, w // self.cp_w

    def latent_block(self, cp_rank: int) -> tuple[slice, slice, slice]:
        """The (T, H, W) index ranges of cp rank ``cp_rank``'s block of the latent."""
        return self._ranges(cp_rank, self.local_thw)

    def token_block(self, cp_rank: int) -> tuple[slice, slice, slice]:
        """The (t, h, w) index ranges of cp rank ``cp_rank``'s block of the token grid."""
        return self._ranges(cp_rank, self.local_token_grid)

    def _ranges(self, cp_rank: int, block: tuple[int, int, int]) -> tuple[slice, slice, slice]:
        i, rest = divmod(cp_rank, self.cp_h * self.cp_w)
        j, k = divmod(rest, self.cp_w)
        (lt, lh, lw) = block
        return slice(i * lt, (i + 1) * lt), slice(j * lh, (j + 1) * lh), slice(k * lw, (k + 1) * lw)

    def block(self, cp_rank: int) -> tuple[slice, slice]:
        """The (T, H) index ranges of cp rank ``cp_rank``'s latent block (W: :meth:`latent_block`)."""
        ts, hs, _ = self.latent_block(cp_rank)
        return ts, hs

    def _check(self, shape: torch.Size, t_dim: int, what: str) -> None:
        if tuple(shape[t_dim : t_dim + 3]) != (self.t, self.h, self.w):
            raise ValueError(f"{what}: expected (T, H, W) = {(self.t, self.h, self.w)}, got shape {tuple(shape)}")

    # ---- single-process views ------------------------------------------------------------------------
    def to_sequence(self, latent: torch.Tensor) -> torch.Tensor:
        """``(B, C, T, H, W)`` -> ``(B, T*H*W, C)`` in block order (the global CP sequence)."""
        self._check(latent.shape, 2, "to_sequence")
        return rearrange(latent, _BLOCKS, nt=self.cp_t, nh=self.cp_h, nw=self.cp_w)

    def from_sequence(self, tokens: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_sequence`."""
        lt, lh, lw = self.local_thw
        return rearrange(
            tokens, "b (nt nh nw t h w) c -> b c (nt t) (nh h) (nw w)", nt=self.cp_t, nh=self.cp_h, t=lt, h=lh, w=lw
        )

    def positions_to_sequence(self, pos: torch.Tensor) -> torch.Tensor:
        """Position embeddings ``(T, H, W, D)`` (or ``(T*H*W, D)`` in natural order) -> block order."""
        return rearrange(self._pos_grid(pos), _POS_BLOCKS, nt=self.cp_t, nh=self.cp_h, nw=self.cp_w)

    def _pos_grid(self, pos: torch.Tensor) -> torch.Tensor:
        if pos.ndim == 2:
            pos = pos.reshape(self.t, self.h, self.w, pos.shape[-1])
        self._check(pos.shape, 0, "positions")
        return pos

    # ---- CP: the latent grid -------------------------------------------------------------------------
    def shard(
        self, latent: torch.Tensor, *, mesh: DeviceMesh | ParallelMesh | None = None, as_dtensor: bool = False
    ) -> torch.Tensor:
        """This cp rank's tokens ``(B, T'*H'*W', C)``: a slice of the latent, no collective, no full copy.

        Returns:
            The tokens (natural ``(t h w)`` order within the block); with ``as_dtensor=True`` a DTensor
            ``Shard(1)`` of the global block-order ``(B, T*H*W, C)`` sequence.
        """
        self._check(latent.shape, 2, "shard")
        mesh = self._mesh(mesh)
        ts, hs, ws = self.latent_block(mesh.get_local_rank())
        tokens = rearrange(latent[:, :, ts, hs, ws], "b c t h w -> b (t h w) c")
        if not as_dtensor:
            return tokens
        b, c = latent.shape[:2]
        return sequence_dtensor(tokens, 1, (b, self.t * self.h * self.w, c), mesh=mesh)

    def shard_positions(self, pos: torch.Tensor, *, mesh: DeviceMesh | ParallelMesh | None = None) -> torch.Tensor:
        """This cp rank's position embeddings ``(T'*H'*W', D)``, matching :meth:`shard` token for token."""
        ts, hs, ws = self.latent_block(self._mesh(mesh).get_local_rank())
        return rearrange(self._pos_grid(pos)[ts, hs, ws], "t h w d -> (t h w) d")

    def gather(
        self, tokens: torch.Tensor, *, mesh: DeviceMesh | ParallelMesh | None = None, grad: GradRule = "replicate"
    ) -> torch.Tensor:
        """Every rank's tokens -> the full latent ``(B, C, T, H, W)``: one all-gather (see ``gather_sequence``)."""
        full = gather_sequence(tokens, 1, mesh=self._mesh(mesh), grad=grad)
        return self.from_sequence(full)

    # ---- CP: the token grid --------------------------------------------------------------------------
    def shard_tokens(
        self, tokens: torch.Tensor, *, dim: int = 1, mesh: DeviceMesh | ParallelMesh | None = None
    ) -> torch.Tensor:
        """This cp rank's patch tokens: ``(B, N, D)`` in natural ``(t h w)`` order -> ``(B, N_local, D)``.

        ``N`` is the token grid's ``T/pt * H/ph * W/pw``; the result holds this rank's block in natural order
        within the block (the module docstring's rule), matching :meth:`positions` row for row. No collective;
        gradient: this rank's slice flows back into ``tokens``.

        Args:
            tokens: every token of the video, in natural ``(t h w)`` order along ``dim`` (any other dims: a
                ``(N, D)`` rotary table with ``dim=0``, a ``(B, heads, N, D)`` one with ``dim=2``).
            dim: the token dim.
            mesh: the cp mesh (as for :meth:`shard`).

        Returns:
            The tokens of this rank's block, ``N_local = N / cp_size`` along ``dim``.

        Raises:
            ValueError: ``tokens.shape[dim]`` is not the token grid's size (or the latent has no whole grid).
        """
        dim = normalize_dim(dim, tokens.ndim, "dim")
        grid = self._token_count(tokens, dim, "shard_tokens")
        ts, hs, ws = self.token_block(self._mesh(mesh).get_local_rank())
        x = tokens.unflatten(dim, grid)
        for offset, s in enumerate((ts, hs, ws)):
            x = x.narrow(dim + offset, s.start, s.stop - s.start)
        return x.flatten(dim, dim + 2)

    def positions(
        self, *, mesh: DeviceMesh | ParallelMesh | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """The global ``(t, h, w)`` token-grid index of every token of :meth:`shard_tokens`, in the same order.

        Args:
            mesh: the cp mesh (as for :meth:`shard`).
            device: where to put them (default: the cp group's device, ``cpu`` on gloo).

        Returns:
            A ``(N_local, 3)`` int64 tensor: row ``n`` is local token ``n``'s frame, row and column on the whole
            video's token grid, as a single process would number it (for RoPE tables, learned embeddings, ...).
        """
        mesh = self._mesh(mesh)
        device = agreement.comm_device(mesh.get_group()) if device is None else device
        axes = [torch.arange(s.start, s.stop, device=device) for s in self.token_block(mesh.get_local_rank())]
        return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)

    def gather_tokens(
        self,
        tokens: torch.Tensor,
        *,
        dim: int = 1,
        mesh: DeviceMesh | ParallelMesh | None = None,
        grad: GradRule = "replicate",
    ) -> torch.Tensor:
        """Every rank's :meth:`shard_tokens` shard -> all ``N`` tokens in natural ``(t h w)`` order: one all-gather.

        Args:
            tokens: this rank's tokens, ``N_local`` along ``dim``, in :meth:`shard_tokens`' order.
            dim: the token dim.
            mesh: the cp mesh (as for :meth:`shard`).
            grad: the backward rule of :func:`~wf_mesh.gather_sequence` (``"replicate"``: every rank computes the
                same loss from the result; ``"partial"``: ranks use it differently, their gradients are summed).

        Returns:
            The full token tensor on every rank, as a single process has it before :meth:`shard_tokens`.

        Raises:
            ShapeMismatchError: (on every rank) local shards that are not ``N / cp_size`` tokens each, or that
                disagree on dtype or the other dims.
        """
        mesh = self._mesh(mesh)
        dim = normalize_dim(dim, tokens.ndim, "dim")
        blocks = gather_sequence(tokens, dim, mesh=mesh, seq_len=math.prod(self.token_grid), grad=grad)
        x = blocks.unflatten(dim, (self.cp_t, self.cp_h, self.cp_w, *self.local_token_grid))
        order = [*range(dim), *(dim + i for i in (0, 3, 1, 4, 2, 5)), *range(dim + 6, x.ndim)]
        return x.permute(order).flatten(dim, dim + 5)

    def _token_count(self, tokens: torch.Tensor, dim: int, what: str) -> tuple[int, int, int]:
        grid = self.token_grid
        if tokens.shape[dim] != math.prod(grid):
            raise ValueError(
                f"{what}: dim {dim} of shape {tuple(tokens.shape)} holds {tokens.shape[dim]} tokens, the token grid "
                f"{grid} (latent {(self.t, self.h, self.w)}, patch {self.patch}) has {math.prod(grid)}"
            )
        return grid

    # ---- attention -----------------------------------------------------------------------------------
    def attention_plan(self, *, mesh: DeviceMesh | ParallelMesh | None = None, tokens: bool = False) -> CPAttentionPlan:
        """The cp_attention plan of this split's token order (every rank the same number of tokens): one agreement
        exchange (while checks are on); pass it to every attention layer of the step.

        Args:
            mesh: the cp mesh (as for :meth:`shard`).
            tokens: plan the token grid's sequence (:meth:`shard_tokens`) instead of the latent's (:meth:`shard`).

        Returns:
            The :class:`~wf_mesh.CPAttentionPlan` of the ``T*H*W`` latent sequence (or the token grid's),
            ``torch.chunk`` shards.
        """
        self._mesh(mesh)
        length = math.prod(self.token_grid) if tokens else self.t * self.h * self.w
        return plan_cp_attention(length, mesh=mesh)

    def _mesh(self, mesh: DeviceMesh | ParallelMesh | None) -> DeviceMesh:
        mesh = cp_mesh(mesh)
        if mesh.size() != self.cp_size:
            raise ValueError(f"this VideoSplit plans {self.cp_size} cp ranks, the mesh has {mesh.size()}")
        return mesh


def plan_video_split(
    shape: torch.Size | tuple[int, ...],
    cp_size: int,
    patch_values: tuple[int, int, int] = (1, 2, 2),
    *,
    split_width: bool = True,
) -> VideoSplit:
    """Plan the CP split of a ``(B, C, T, H, W)`` latent over ``cp_size`` ranks: time first, then height, then width.

    Walking T, H, W with ``remaining = cp_size``: ``g = gcd(size // patch, remaining)`` ranks split that dim
    and ``remaining //= g``. So W is split only by what T and H cannot take, and any split the sizes allow is
    found (prime by prime, each dim takes all it can). Pure: no collective, no global state.

    Args:
        shape: the latent's ``(B, C, T, H, W)``.
        cp_size: the cp ranks.
        patch_values: the model's patch size ``(pt, ph, pw)``: blocks are whole patches, and it is the
            :class:`VideoSplit`'s ``patch`` (the token grid of :meth:`VideoSplit.shard_tokens`).
        split_width: False refuses a plan that would split W (for callers whose models cannot take a width split).

    Returns:
        The plan: the latent's ``(t, h, w)``, the ranks that split T, H and W (``cp_t``, ``cp_h``, ``cp_w``)
        and the patch.

    Raises:
        TypeError: a size, ``cp_size`` or patch value that is not an int.
        ValueError: not 5 dims, a size or patch < 1; a factor of ``cp_size`` that no dim can take (or that is
            left for W with ``split_width=False``); or a split dim that would not cut into equal blocks of whole
            patches (it would drop rows: H=5 over 2 ranks).
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
    for name, size, patch in zip(_DIMS, (t, h, w), patches):
        if name == "W" and not split_width and remaining != 1:
            raise ValueError(
                f"plan_video_split: cannot split (T={t}, H={h}, W={w}) with patch {tuple(patches)} over cp_size="
                f"{cp_size}: a factor {remaining} is left for W, which is never split"
            )
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
        whole = ", ".join(f"{n}={s} ({s // p} patches of {p})" for n, s, p in zip(_DIMS, (t, h, w), patches))
        raise ValueError(
            f"plan_video_split: cannot split (T={t}, H={h}, W={w}) with patch {tuple(patches)} over cp_size="
            f"{cp_size}: after T, H and W took {splits[0]} x {splits[1]} x {splits[2]} ranks, a factor {remaining} "
            f"divides none of {whole}; cp_size must divide the number of patches ({t // patches[0]} x "
            f"{h // patches[1]} x {w // patches[2]})"
        )
    patch_size = (patches[0], patches[1], patches[2])
    return VideoSplit(t=t, h=h, w=w, cp_t=splits[0], cp_h=splits[1], cp_w=splits[2], patch=patch_size)
