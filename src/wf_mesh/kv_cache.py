"""KV-cache decoding under context parallelism: autoregressive generation chunk by chunk, exact.

A world model generates chunk after chunk (a few latent frames each). The queries of the newest chunk attend to
the cached keys and values of every earlier chunk and to the chunk's own (block-causal: inside the chunk
attention is full, every cached key is visible), optionally only the last ``window`` chunks (chunk ``c`` sees
chunks ``c - window .. c``: :meth:`wf_mesh.RangeMask.chunk_window`; older chunks are evicted). The outputs equal
block-causal attention over the whole sequence, chunk by chunk::

    cache = wf_mesh.KVCache(mesh=pm, layers=depth, batch=B, heads=H, kv_heads=Hkv, head_dim=D)
    for chunk in chunks:                                  # (B, L, C) tokens of one chunk, the same on every rank
        step = cache.next_chunk(chunk.shape[1])           # ONE agreement per chunk, not per layer
        x = step.shard(chunk, 1)                          # this rank's tokens of the chunk (a view)
        for layer, block in enumerate(blocks):            # q, k, v: (B, H, S_local, D)
            out = step.attend(layer, q, k, v)             # appends k, v to the layer's cache; no host sync
        y = step.gather(x, 1)                             # the whole chunk again, on every rank

**Design: split-KV ("flash-decoding") over the cp ranks; the cache never moves.** The cache is the big side
(every earlier token, per layer) and the chunk the small one, so the chunk's queries travel, not the cache.
Per layer call, with ``n`` cp ranks and the chunk's ``L`` tokens split ``s_0 .. s_{n-1}`` over them:

1. this rank writes its shard of the chunk's k, v into its cache shard (a pre-allocated buffer);
2. one all-gather of the chunk's queries (each shard padded to ``m = max(s)`` rows: ``n * m < L + n``);
3. every rank attends ALL the chunk's queries to its own keys (its cache shard, now holding its shard of the
   chunk too) in ONE fused kernel call returning ``(out, lse)`` (:func:`wf_mesh.attention_kernels.attend`, the
   kernel :func:`~wf_mesh.attention_kernels.choose_kernel` picked once);
4. one all-to-all hands each query's ``n`` partial results (out and lse packed in one buffer, accumulation
   dtype) to the rank that owns the query, which merges them by log-sum-exp (online softmax, vectorized).

Two collectives per layer call (``_allgather_base_``, ``alltoall_base_``), whatever the cache length; none at
cp 1. Traffic per rank ~ ``(n-1)/n`` of the chunk's q and out: independent of the cache. A ring over the cache
(ring attention's pattern) would move ``n-1`` cache blocks per layer, and all-gathering K/V would move and hold
the whole cache on every rank. Because every cached key is visible to every query of the chunk, the order of
tokens inside the cache does not matter: a rank's cache shard is any set of earlier tokens, so shards are
balanced freely (below) and a window is an eviction from the front of each shard.

**Balance.** ``next_chunk`` deals the chunk's tokens as if every token ever appended were dealt round-robin
over the ranks (token ``p`` of the whole generation to rank ``p % n``), counted per rank and handed out as
contiguous slices of the chunk in rank order: the uneven remainder rotates from chunk to chunk, so the cache
shards (and a window's, which hold a contiguous run of that dealing) are always within one token of each other
(``cache.lengths``), and every rank attends the same number of (query, key) pairs give or take one key. A rank
may get no token of a small chunk; it still attends every query to its cache shard.

**The cache's memory.** Per layer two buffers ``(B, capacity, Hkv, D)`` (``capacity=`` tokens per rank
allocates them once, at the first attend; without it they start at twice the first chunk and double when full,
an amortized copy per token), written in place at each attend (no ``torch.cat`` per chunk) and read as one
``(B, Hkv, S, D)`` strided view by the kernel. A window's evicted tokens are dropped from the front by moving a
start index; the live part is compacted when the end reaches the capacity.

**Agreed once.** ``KVCache(...)`` agrees on layers, shapes, dtype, window, capacity and scale (one exchange);
``next_chunk(chunk_len, append=...)`` on the chunk length, the chunk index, the cached token count and
``append`` (one exchange per chunk, skipped with checks off). Everything a layer call's collectives need is
then fixed, so ``attend`` checks its inputs locally (layer order, shapes against the step's shard, dtype,
device, no gradient) with no collective and no host sync. A misuse every rank makes (the usual case: every
rank runs the same model code) raises on every rank at once; with fault containment on
(``init_parallel(contain_faults=True)``) a misuse or a failure on one rank only is recorded, the layer's
collectives still run (zero buffers), and every rank raises it at the layer's verdict exchange
(:class:`wf_mesh.faults.FaultSequence`); without containment its peers wait in the layer's all-gather until the
group's timeout (:class:`~wf_mesh.errors.CollectiveTimeoutError` naming ``KVCache.attend``). A step that raised
is rolled back by the next ``next_chunk`` (the cache as before that chunk: retry it); a step that skipped its
last layers raises there, on every rank, and is rolled back too.

**Denoising passes.** A diffusion world model denoises a chunk in several passes over the same cached context
and then commits the clean chunk's keys and values: ``next_chunk(L, append=False)`` attends like any step but
leaves the cache as it was (its k, v are written past the cache's end and not kept); ``append=True`` (the
default) keeps them.

Inference only: inputs that require grad are refused (run the decode under ``torch.no_grad()`` or
``torch.inference_mode()``); training uses :func:`wf_mesh.cp_attention` with a block-causal mask plan.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from wf_mesh import _compat, waits
from wf_mesh.agreement import Facts, agree, fact
from wf_mesh.attention_kernels import accumulation_dtype, attend, choose_kernel
from wf_mesh.attention_plan import MeshArg, cp_of
from wf_mesh.context_parallel import normalize_dim
from wf_mesh.errors import ShapeMismatchError, StateError
from wf_mesh.faults import FaultSequence
from wf_mesh.mesh import ParallelMesh
from wf_mesh.topology import as_int

__all__ = ["KVCache", "KVCacheStep", "chunk_shares"]

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def chunk_shares(dealt: int, length: int, parts: int) -> list[int]:
    """Each rank's token count of a chunk of ``length`` tokens after ``dealt`` tokens: the tokens of the whole
    generation dealt round-robin (token ``p`` to rank ``p % parts``), counted per rank.

    Returns:
        ``parts`` counts summing to ``length``; any run of consecutive chunks gives counts within one.
    """

    def count(tokens: int, rank: int) -> int:
        return tokens // parts + (rank < tokens % parts)

    return [count(dealt + length, r) - count(dealt, r) for r in range(parts)]


@dataclasses.dataclass(frozen=True)
class _CacheFacts(Facts):
    layers: int
    batch: int
    heads: int = fact(label="query heads")
    kv_heads: int = fact(label="kv heads")
    head_dim: int = fact(label="head dim")
    dtype: torch.dtype = fact()
    window: int | None = fact()
    capacity: int | None = fact()
    scale: float = fact()


@dataclasses.dataclass(frozen=True)
class _ChunkFacts(Facts):
    chunk_len: int = fact(label="chunk length")
    index: int = fact(label="chunk index")
    cached: int = fact(label="cached tokens")
    append: bool = fact()


@dataclasses.dataclass(frozen=True)
class _GatherFacts(Facts):
    dtype: torch.dtype
    seq_dim: int
    other_dims: tuple[int, ...] = fact(label="other dims")


class _Layer:
    """One layer's cache shard: k and v buffers ``(B, capacity, Hkv, D)``, live rows ``[start, end)``."""

    __slots__ = ("end", "k", "start", "v")

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.start = 0
        self.end = 0

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def reserve(self, extra: int, cache: KVCache) -> None:
        """Room for ``extra`` rows after ``end`` (allocating, growing or compacting the buffers)."""
        if self.k is not None and self.end + extra <= self.capacity:
            return
        live = self.end - self.start
        need = live + extra
        if self.k is None:
            size = max(need, cache.capacity_hint) if cache.capacity_hint else 2 * need
        else:
            size = max(self.capacity, 2 * need)
        shape = (cache.batch, size, cache.kv_heads, cache.head_dim)
        k = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        v = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        if live and self.k is not None and self.v is not None:
            k[:, :live] = self.k[:, self.start : self.end]
            v[:, :live] = self.v[:, self.start : self.end]
        self.k, self.v, self.start, self.end = k, v, 0, live
        cache.reallocations += 1

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``(B, Hkv, s, D)`` k, v at rows ``[end, end + s)`` (``end`` unchanged)."""
        assert self.k is not None and self.v is not None  # reserve() ran
        s = k.shape[2]
        self.k[:, self.end : self.end + s] = k.transpose(1, 2)
        self.v[:, self.end : self.end + s] = v.transpose(1, 2)

    def keys(self, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, Hkv, stop - start, D)`` views of the live k, v up to row ``stop``."""
        assert self.k is not None and self.v is not None
        return self.k[:, self.start : stop].transpose(1, 2), self.v[:, self.start : stop].transpose(1, 2)


class KVCache:
    """The keys and values of every generated chunk, per layer, sharded over the cp ranks (module docstring).

    Construction is collective over the cp group (one agreement exchange): every rank must pass the same values.

    Args:
        mesh: a ParallelMesh (its ``cp`` axis), a 1-D cp DeviceMesh, a 2-D ``("cp_ring", "cp_ulysses")``
            DeviceMesh (flattened: decoding uses the whole cp axis), or None: the current ParallelMesh.
        layers: the attention layers that share the cache (``step.attend(layer, ...)``, ``0 .. layers-1``).
        batch: B of q, k, v.
        heads: query heads H.
        head_dim: D.
        kv_heads: key/value heads (GQA: dividing ``heads``; query head h uses kv head ``h // (heads //
            kv_heads)``); default ``heads``.
        dtype: of q, k, v and the cache (float32, float64, bfloat16, float16).
        device: of q, k, v and the cache; default the ParallelMesh's device, else the mesh's device type.
        window: chunk c attends to chunks ``c - window .. c`` only (older ones are evicted); None: all.
        capacity: tokens per rank to allocate per layer at the first attend (None: grow by doubling).
        scale: the softmax scale (default ``1 / sqrt(head_dim)``).

    Raises:
        DisagreementError: (on every rank) ranks passing different values.
        ShapeMismatchError: (on every rank) ranks passing different shapes or dtypes.
    """

    def __init__(
        self,
        *,
        mesh: MeshArg = None,
        layers: int,
        batch: int,
        heads: int,
        head_dim: int,
        kv_heads: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        window: int | None = None,
        capacity: int | None = None,
        scale: float | None = None,
    ) -> None:
        cp = cp_of(mesh)
        self._group = cp.get_group()
        self._n, self._rank = cp.size(), cp.get_local_rank()

        def facts() -> _CacheFacts:
            n_layers = as_int("layers", layers, minimum=1)
            b, h, d = (
                as_int(name, x, minimum=1) for name, x in (("batch", batch), ("heads", heads), ("head_dim", head_dim))
            )
            hkv = h if kv_heads is None else as_int("kv_heads", kv_heads, minimum=1)
            if h % hkv:
                raise ValueError(f"KVCache: kv_heads={hkv} does not divide heads={h} (grouped-query attention)")
            if dtype not in _FLOATS:
                raise TypeError(f"KVCache: dtype={dtype}: use one of {[str(t) for t in _FLOATS]}")
            w = None if window is None else as_int("window", window, minimum=0)
            cap = None if capacity is None else as_int("capacity", capacity, minimum=1)
            if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)):
                raise TypeError(f"KVCache: scale must be a float or None, got {type(scale).__name__} {scale!r}")
            s = 1.0 / math.sqrt(d) if scale is None else float(scale)
            return _CacheFacts(n_layers, b, h, hkv, d, dtype, w, cap, s)

        agreed = agree(self._group, facts, what="KVCache")
        for name in ("layers", "window", "capacity", "scale"):
            agreed.require_same(name)
        for name in ("batch", "heads", "kv_heads", "head_dim", "dtype"):
            agreed.require_same(name, error=ShapeMismatchError)
        mine = agreed.mine
        self.layers, self.batch, self.heads, self.kv_heads = mine.layers, mine.batch, mine.heads, mine.kv_heads
        self.head_dim, self.dtype, self.window, self.scale = mine.head_dim, mine.dtype, mine.window, mine.scale
        self.capacity_hint = mine.capacity
        if device is None:
            device = mesh.device if isinstance(mesh, ParallelMesh) else _mesh_device(cp.device_type)
        self.device = torch.device(device)
        self.kernel = choose_kernel(self.device, self.dtype, self.head_dim, padded=False).kernel
        self.reallocations = 0
        """How many times a layer's buffers were (re)allocated (tests: none after the first with ``capacity``)."""
        self._layers = [_Layer() for _ in range(self.layers)]
        self._chunks: list[tuple[int, ...]] = []  # each cached chunk's shares, oldest first
        self._dealt = 0  # tokens appended since the start (the round-robin position)
        self._index = 0  # chunks appended
        self._step: KVCacheStep | None = None

    # ---- what it holds -----------------------------------------------------------------------------------
    @property
    def chunks(self) -> int:
        """Chunks appended so far (the index of the next chunk)."""
        return self._index

    @property
    def lengths(self) -> tuple[int, ...]:
        """Cached tokens on each cp rank (every layer alike), in cp-rank order; within one of each other."""
        return tuple(sum(shares[r] for shares in self._chunks) for r in range(self._n))

    @property
    def tokens(self) -> int:
        """Cached tokens over all cp ranks (what the next chunk's queries see besides their own chunk)."""
        return sum(sum(shares) for shares in self._chunks)

    @property
    def capacity(self) -> int:
        """Tokens this rank's buffers hold per layer (0 before the first attend)."""
        return self._layers[0].capacity

    # ---- one chunk ---------------------------------------------------------------------------------------
    def next_chunk(self, chunk_len: int, *, append: bool = True) -> KVCacheStep:
        """Start the next chunk: one agreement exchange (every rank passes the same arguments).

        Args:
            chunk_len: the chunk's tokens (over all cp ranks), >= 1.
            append: keep the chunk's keys and values in the cache (False: a denoising pass that attends to
                the cache and its own keys but leaves the cache as it was).

        Returns:
            The step: its shards (:attr:`KVCacheStep.sizes`), ``shard`` / ``gather``, ``attend`` per layer.

        Raises:
            StateError: (on every rank) the previous step attended only some layers (it is rolled back).
            DisagreementError: (on every rank) ranks passing a different ``chunk_len`` or ``append``.
        """
        problem = self._close_step()

        def facts() -> _ChunkFacts:
            if problem:
                raise StateError(problem)
            length = as_int("chunk_len", chunk_len, minimum=1)
            if not isinstance(append, bool):
                raise TypeError(f"append must be a bool, got {type(append).__name__} {append!r}")
            return _ChunkFacts(length, self._index, self.tokens, append)

        agreed = agree(self._group, facts, what="KVCache.next_chunk")
        for name in ("chunk_len", "append"):
            agreed.require_same(name)
        agreed.require_same("index", "cached", hint=" (a cache that missed a chunk on some rank)")
        length = agreed.mine.chunk_len
        sizes = tuple(chunk_shares(self._dealt, length, self._n))
        self._step = KVCacheStep(self, self._index, length, sizes, append)
        return self._step

    def _close_step(self) -> str:
        """Roll back an unfinished previous step; the message to raise when it did not fail but stopped."""
        step, self._step = self._step, None
        if step is None or step._done:
            return ""
        for layer, added in zip(self._layers, step._appended):
            layer.end -= added
        if step._failed:
            return ""
        return (
            f"chunk {step.index}'s step attended layers 0 .. {step._next - 1} of {self.layers} (layer {step._next} "
            "and later were never called); every layer must attend once per step. The cache is rolled back to "
            "before that chunk"
            if step._next
            else ""
        )

    def _commit(self, step: KVCacheStep) -> None:
        if not step.append:
            return
        self._chunks.append(step.sizes)
        self._dealt += step.chunk_len
        self._index += 1
        while self.window is not None and len(self._chunks) > self.window:
            evicted = self._chunks.pop(0)[self._rank]
            for layer in self._layers:
                layer.start += evicted


def _mesh_device(device_type: str) -> torch.device:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


class KVCacheStep:
    """One chunk of a :class:`KVCache` (from :meth:`KVCache.next_chunk`): which of its tokens this rank holds,
    and the per-layer attention.

    Attributes:
        index: the chunk's index (chunks appended before it).
        chunk_len: its tokens over all cp ranks.
        sizes: each cp rank's tokens of the chunk (contiguous slices, in cp-rank order).
        offset: where this rank's slice starts.
        local_len: this rank's tokens of the chunk.
        append: whether the chunk's keys and values stay in the cache.
        cached: each rank's cached tokens before the chunk (what its queries see besides the chunk).
    """

    def __init__(self, cache: KVCache, index: int, chunk_len: int, sizes: tuple[int, ...], append: bool) -> None:
        self._cache = cache
        self.index, self.chunk_len, self.sizes, self.append = index, chunk_len, sizes, append
        rank = cache._rank
        self.offset = sum(sizes[:rank])
        self.local_len = sizes[rank]
        self.cached = cache.lengths
        self._next = 0  # the layer expected next
        self._appended = [0] * cache.layers  # rows each layer added (rolled back if the step does not finish)
        self._done = False
        self._failed = False

    # ---- moving the chunk's tokens ---------------------------------------------------------------------
    def shard(self, x: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """This rank's tokens of the chunk ``x`` (the whole chunk, the same on every rank): a view, no collective.

        Returns:
            ``x.narrow(seq_dim, offset, local_len)``.

        Raises:
            ShapeMismatchError: ``x``'s ``seq_dim`` is not the chunk's length.
        """
        dim = normalize_dim(seq_dim, x.ndim)
        if x.shape[dim] != self.chunk_len:
            raise ShapeMismatchError(
                f"KVCacheStep.shard: dim {dim} of x {tuple(x.shape)} has {x.shape[dim]} tokens; chunk "
                f"{self.index} has {self.chunk_len}"
            )
        return x.narrow(dim, self.offset, self.local_len)

    def gather(self, y: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """The whole chunk from every rank's ``y`` (its tokens of the chunk along ``seq_dim``): one agreement
        and one all-gather (shards padded to the longest). A plain tensor without gradient.

        Returns:
            The chunk in order, on every rank.

        Raises:
            ShapeMismatchError: (on every rank) a shard that is not this rank's slice of the chunk, or ranks
                whose other dims or dtypes differ.
        """
        cache = self._cache
        dim = normalize_dim(seq_dim, y.ndim)

        def facts() -> _GatherFacts:
            if y.shape[dim] != self.local_len:
                raise ShapeMismatchError(
                    f"dim {dim} of y {tuple(y.shape)} has {y.shape[dim]} tokens; this rank holds {self.local_len} "
                    f"of chunk {self.index} (shares {list(self.sizes)})"
                )
            return _GatherFacts(y.dtype, dim, tuple(s for i, s in enumerate(y.shape) if i != dim))

        agreed = agree(cache._group, facts, what="KVCacheStep.gather")
        agreed.require_same("dtype", "seq_dim", "other_dims", error=ShapeMismatchError)
        if cache._n == 1:
            return y.detach()
        longest = max(self.sizes)
        moved = y.detach().movedim(dim, 0)
        send = moved.new_zeros(longest, *moved.shape[1:])
        send[: moved.shape[0]] = moved
        recv = send.new_empty(cache._n * longest, *moved.shape[1:])
        with waits.bounded(cache._group, "KVCacheStep.gather"):
            _compat.all_gather_single(recv, send, group=cache._group)
        pieces = [recv[r * longest : r * longest + s] for r, s in enumerate(self.sizes)]
        return torch.cat(pieces, dim=0).movedim(0, dim)

    # ---- attention ---------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of this rank's queries of the chunk to every cached key of ``layer`` and the chunk's own;
        appends this rank's ``k``, ``v`` to the layer's cache (with ``append``). No agreement, no host sync:
        one all-gather and one all-to-all at cp > 1 (module docstring).

        Args:
            layer: the layer, ``0 .. layers-1``, each once per step and in order.
            q: this rank's queries of the chunk ``(B, H, local_len, D)``.
            k: its keys ``(B, Hkv, local_len, D)``.
            v: its values, shaped as k.

        Returns:
            ``(B, H, local_len, D)`` in the cache's dtype.

        Raises:
            StateError: a step that is no longer the cache's current one, or one that already failed.
            ValueError: a layer out of order or out of range; inputs that require grad.
            ShapeMismatchError: q, k, v not shaped as this rank's shard of the chunk.
            TypeError: q, k, v of another dtype or device than the cache's.
        """
        try:
            return self._attend(layer, q, k, v)
        except BaseException:
            self._failed = True
            raise

    def _check(self, layer: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        cache = self._cache
        if cache._step is not self:
            raise StateError(f"chunk {self.index}'s step is not the cache's current one (next_chunk was called since)")
        if self._done:
            raise StateError(f"chunk {self.index}'s step attended all {cache.layers} layers already")
        if self._failed:
            raise StateError(
                f"chunk {self.index}'s step failed at an earlier layer; call next_chunk to retry the chunk"
            )
        index = as_int("layer", layer)
        if not 0 <= index < cache.layers:
            raise ValueError(f"layer={index}: the cache has layers 0 .. {cache.layers - 1}")
        if index < self._next:
            raise ValueError(
                f"layer={index} attended twice in chunk {self.index}'s step (layer {self._next} comes next)"
            )
        if index != self._next:
            done = "none" if not self._next else f"0 .. {self._next - 1}"
            raise ValueError(
                f"layer={index} out of order: chunk {self.index}'s step attended layers {done}, so layer {self._next} "
                "comes next (every layer attends once per step, in order)"
            )
        b, h, hkv, d, s = cache.batch, cache.heads, cache.kv_heads, cache.head_dim, self.local_len
        for name, x, heads in (("q", q, h), ("k", k, hkv), ("v", v, hkv)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
            if tuple(x.shape) != (b, heads, s, d):
                raise ShapeMismatchError(
                    f"{name} {tuple(x.shape)} is not this rank's shard (B, H, S, D) = {(b, heads, s, d)} of chunk "
                    f"{self.index} (shares {list(self.sizes)}, this rank's offset {self.offset})"
                )
            if x.dtype != cache.dtype:
                raise TypeError(f"{name} is {x.dtype}; the cache holds {cache.dtype}")
            if x.device.type != cache.device.type or (
                cache.device.index is not None and x.device.index != cache.device.index
            ):
                raise TypeError(f"{name} is on {x.device}; the cache is on {cache.device}")
            if x.requires_grad:
                raise ValueError(
                    f"{name} requires grad: KVCache is inference only; decode under torch.no_grad() or "
                    "torch.inference_mode() (training: cp_attention with a block-causal mask plan)"
                )

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self._cache
        n, s = cache._n, self.local_len
        b, h, d = cache.batch, cache.heads, cache.head_dim
        seq = FaultSequence(cache._group, "KVCache.attend")
        at = (layer + 1 if isinstance(layer, int) else 0, cache.layers)
        seq.step(("validation of layer", *at), self._check, layer, q, k, v)
        store = cache._layers[min(self._next, cache.layers - 1)]  # unused when the validation failed (contained)
        if n == 1:  # no peers: the local attention is the result
            seq.step(("cache append of layer", *at), self._append, store, k, v)
            out = seq.step(("local attention of layer", *at), self._local, store, q)
            seq.close()
            self._advance()
            return out[0].to(cache.dtype).contiguous()  # the math kernel's out is in the accumulation dtype
        acc, longest = accumulation_dtype(cache.dtype), max(self.sizes)
        send = torch.zeros(longest, b, h, d, dtype=cache.dtype, device=cache.device)
        seq.step(("cache append of layer", *at), self._append, store, k, v, q, send)
        queries = torch.empty(n * longest, b, h, d, dtype=cache.dtype, device=cache.device)
        with waits.bounded(cache._group, "KVCache.attend"):
            _compat.all_gather_single(queries, send, group=cache._group)
        partial = torch.empty(n * longest, b, h, d + 1, dtype=acc, device=cache.device)
        seq.step(("local attention of layer", *at), self._local, store, queries.permute(1, 2, 0, 3), partial)
        parts = torch.empty_like(partial)
        with waits.bounded(cache._group, "KVCache.attend"):
            dist.all_to_all_single(parts, partial, group=cache._group)
        out = seq.step(("merge of layer", *at), _merge, parts.view(n, longest, b, h, d + 1)[:, :s], cache.dtype)
        seq.close()
        self._advance()
        return out

    def _append(self, store: _Layer, k: torch.Tensor, v: torch.Tensor, q=None, send=None) -> None:
        """This rank's k, v into the layer's cache (kept with ``append``); q into the all-gather's buffer."""
        s = self.local_len
        store.reserve(s, self._cache)
        store.write(k, v)
        if self.append:
            store.end += s
            self._appended[self._next] = s
        if send is not None:
            send[:s] = q.permute(2, 0, 1, 3)

    def _local(self, store: _Layer, queries: torch.Tensor, partial: torch.Tensor | None = None):
        """``queries`` against this rank's keys (its cache shard and its shard of the chunk).

        Returns:
            ``(out, lse)``; None when they are packed into ``partial`` (rows, B, H, D + 1) in the accumulation
            dtype instead.
        """
        cache = self._cache
        stop = store.end if self.append else store.end + self.local_len
        keys, values = store.keys(stop)
        d = cache.head_dim
        if keys.shape[2] == 0:  # no key on this rank yet (the CPU flash kernel cannot take 0 keys)
            assert partial is not None  # at cp 1 the chunk's own keys are here
            partial[..., :d].zero_()
            partial[..., d].fill_(-math.inf)
            return None
        out, lse = attend(queries, keys, values, None, False, cache.scale, cache.kernel)
        if partial is None:
            return out, lse
        partial[..., :d] = out.permute(2, 0, 1, 3)
        partial[..., d] = lse.permute(2, 0, 1)
        return None

    def _advance(self) -> None:
        self._next += 1
        if self._next == self._cache.layers:
            self._done = True
            self._cache._commit(self)


def _merge(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Merge ``n`` partial results ``(n, S, B, H, D + 1)`` (out, then lse, per key shard) by log-sum-exp.

    Returns:
        ``(B, H, S, D)`` in ``dtype``, contiguous.
    """
    lse, outs = parts[..., -1], parts[..., :-1]
    top = lse.amax(0)
    top = top.masked_fill(top == -math.inf, 0)  # every shard without keys: weights 0 (rows have keys somewhere)
    weights = torch.exp(lse - top)
    merged = (weights.unsqueeze(-1) * outs).sum(0) / weights.sum(0).unsqueeze(-1)
    return merged.permute(1, 2, 0, 3).to(dtype).contiguous()
