"""KV-cache decoding under CP (wf_mesh.kv_cache) on real gloo clusters: a tiny block-causal transformer decoded
chunk by chunk with ``KVCache`` at cp 1, 2 and 4 (and a 2x2 usp mesh, flattened), compared with

(a) the same decode at cp 1 (one process), and
(b) the whole sequence through the same model with dense ``RangeMask.chunk_window(sizes, window).dense()``
    masks and ``F.scaled_dot_product_attention`` (a block-causal model's chunk c depends on chunks <= c only, so
    its decode is exactly its full-sequence forward).

float64 within 1e-10, fp32 within 1e-5, bf16 within 3e-2 (abs + rel; bf16 measured: 5.8e-3 .. 7.8e-3 against
the float64 reference and cp 1, the single-process decode itself 6.6e-3: the projections round to 8 bits). Every world runs its whole case list in ONE run_distributed
call. Also pinned: the c10d ops of each call (``wf_mesh.testing.c10d_ops``), no host sync per layer call, the
cache shards within one token as they grow (and under a window), no reallocation with ``capacity``, and every
misuse raising on every rank.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import wf_mesh
from wf_mesh.errors import DisagreementError, ShapeMismatchError, StateError
from wf_mesh.kv_cache import chunk_shares
from wf_mesh.testing import c10d_ops, host_syncs, injected_fault, run_distributed

from helpers import raised_everywhere

TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}
B, C, D = 2, 16, 4  # batch, model width, head dim


@dataclasses.dataclass(frozen=True)
class Spec:
    chunks: tuple[int, ...]
    heads: int = 4
    kv_heads: int = 4
    dtype: str = "float64"
    layers: int = 2
    window: int | None = None
    capacity: int | None = None
    denoise: int = 0  # passes with append=False before each chunk's appending pass

    @property
    def id(self) -> str:
        parts = [
            "c" + "-".join(map(str, self.chunks)),
            f"h{self.heads}kv{self.kv_heads}",
            self.dtype,
            f"L{self.layers}",
        ]
        parts += [f"w{self.window}"] * (self.window is not None) + [f"cap{self.capacity}"] * bool(self.capacity)
        return "_".join(parts + [f"denoise{self.denoise}"] * bool(self.denoise))


SPECS = [
    Spec((5, 3, 8), kv_heads=2),  # at cp 4 rank 0 holds none of chunk 1
    Spec((4, 4, 4, 4), dtype="float32", layers=3, capacity=16),  # even; pre-allocated: no reallocation
    Spec((3, 6, 2, 5), kv_heads=1, window=1),  # chunk c sees chunks c-1, c: older ones evicted
    Spec((2, 7, 3), heads=2, kv_heads=2, dtype="float32", window=0, denoise=2),
    Spec((3, 5)),  # at cp 4 rank 3 has no token and no cached key in chunk 0
    Spec((4,) * 12, dtype="float32", layers=1, window=1),  # a long windowed decode: the buffers stop growing
    Spec((5, 3, 8), kv_heads=2, dtype="bfloat16", layers=1),  # partials merged in fp32
]
USP_SPEC = Spec((5, 3, 8), kv_heads=2, layers=1)
WORLD_SPECS = {1: SPECS, 2: SPECS, 4: [*SPECS, dataclasses.replace(USP_SPEC)]}


# ---- the model: block-causal attention layers around an attention function -----------------------------
def weights(spec):
    g = torch.Generator().manual_seed(zlib.crc32(spec.id.encode()))
    dtype = getattr(torch, spec.dtype)

    def w(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5).to(dtype)

    layers = [
        (w(C, spec.heads * D), w(C, spec.kv_heads * D), w(C, spec.kv_heads * D), w(spec.heads * D, C), w(C, C))
        for _ in range(spec.layers)
    ]
    x = torch.randn(B, sum(spec.chunks), C, generator=g, dtype=torch.float64).to(dtype)
    return layers, x


def forward(spec, layers, x, attention):
    """The model on tokens ``x`` (B, S, C); ``attention(layer, q, k, v)`` on (B, H, S, D)."""
    s = x.shape[1]
    for i, (wq, wk, wv, wo, w1) in enumerate(layers):
        q = (x @ wq).view(B, s, spec.heads, D).transpose(1, 2)
        k = (x @ wk).view(B, s, spec.kv_heads, D).transpose(1, 2)
        v = (x @ wv).view(B, s, spec.kv_heads, D).transpose(1, 2)
        x = x + attention(i, q, k, v).transpose(1, 2).reshape(B, s, spec.heads * D) @ wo
        x = x + torch.tanh(x @ w1)
    return x


def dense_reference(spec):
    """The whole sequence through the model with the dense chunk-window mask (True = attend), in float64."""
    layers, x = weights(spec)
    layers = [tuple(w.double() for w in layer) for layer in layers]
    mask = wf_mesh.RangeMask.chunk_window(list(spec.chunks), spec.window).dense()
    sdpa = lambda i, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return forward(spec, layers, x.double(), sdpa)


def counter():
    counts = collections.Counter()
    return counts, c10d_ops(lambda name, args: counts.update([name]))


# ---- distributed runs ----------------------------------------------------------------------------------
def decode(spec, mesh):
    layers, x = weights(spec)
    cache = wf_mesh.KVCache(
        mesh=mesh, layers=spec.layers, batch=B, heads=spec.heads, kv_heads=spec.kv_heads, head_dim=D,
        dtype=getattr(torch, spec.dtype), window=spec.window, capacity=spec.capacity,
    )  # fmt: skip
    result = {"outputs": [], "lengths": [], "denoised": [], "attend_ops": [], "syncs": 0, "shares": []}
    start = 0
    for length in spec.chunks:
        chunk = x[:, start : start + length]
        start += length
        for _ in range(spec.denoise):  # leaves the cache as it was
            before = cache.lengths, cache.chunks
            step = cache.next_chunk(length, append=False)
            out = forward(spec, layers, step.shard(chunk, 1), step.attend)
            result["denoised"].append((step.gather(out, 1), before == (cache.lengths, cache.chunks)))
        ops, counting = counter()
        with counting:
            step = cache.next_chunk(length)
        result["next_chunk_ops"] = dict(ops)
        result["shares"].append(step.sizes)
        local = step.shard(chunk, 1)
        syncs = []

        def attend(i, q, k, v, step=step, syncs=syncs):
            ops, counting = counter()
            with counting, host_syncs(syncs.append):
                out = step.attend(i, q, k, v)
            result["attend_ops"].append(dict(ops))
            return out

        out = forward(spec, layers, local, attend)
        result["syncs"] += len(syncs)
        ops, counting = counter()
        with counting:
            result["outputs"].append(step.gather(out, 1))
        result["gather_ops"] = dict(ops)
        result["lengths"].append(cache.lengths)
    result["reallocations"] = cache.reallocations
    result["capacity"] = cache.capacity
    return result


def run_world(specs):
    n = dist.get_world_size()
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=n))
    out = []
    for spec in specs:
        mesh = pm
        if spec == USP_SPEC and n == 4:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_ulysses"))
        with torch.no_grad():
            out.append(decode(spec, mesh))
    return out


@pytest.fixture(scope="module")
def world_results():
    cache = {}

    def get(world):
        if world not in cache:
            specs = WORLD_SPECS[world]
            per_rank = run_distributed(world, run_world, specs)
            cache[world] = {
                s.id + ("-usp" if i == len(SPECS) else ""): [r[i] for r in per_rank] for i, s in enumerate(specs)
            }
        return cache[world]

    return get


def close(got, want, tol):
    return torch.allclose(got.double(), want.double(), atol=tol, rtol=tol)


CASES = [(w, s.id) for w in (1, 2, 4) for s in SPECS] + [(4, USP_SPEC.id + "-usp")]
BY_ID = {s.id: s for s in SPECS} | {USP_SPEC.id + "-usp": USP_SPEC}


@pytest.mark.parametrize(("world", "case"), CASES, ids=[f"cp{w}-{c}" for w, c in CASES])
def test_decode_matches_dense_block_causal_attention_and_one_process(world, case, world_results):
    spec = BY_ID[case]
    ranks = world_results(world)[case]
    want = dense_reference(spec)
    single = world_results(1).get(spec.id, [{}])[0].get("outputs") if world > 1 else None
    tol = TOL[spec.dtype]
    for r in ranks:
        got = torch.cat(r["outputs"], 1)
        assert got.dtype == getattr(torch, spec.dtype) and got.shape == want.shape
        assert close(got, want, tol), (r, (got.double() - want).abs().max())
        if single is not None:  # (a): the same decode in one process
            assert close(got, torch.cat(single, 1), tol)
        for _, unchanged in r["denoised"]:  # a non-appending pass: the same outputs, the cache untouched
            assert unchanged
        if spec.denoise:
            for c, out in enumerate(r["outputs"]):
                assert all(torch.equal(d, out) for d, _ in r["denoised"][c * spec.denoise : (c + 1) * spec.denoise])


@pytest.mark.parametrize(("world", "case"), CASES, ids=[f"cp{w}-{c}" for w, c in CASES])
def test_messages_per_call_are_pinned_and_no_host_sync(world, case, world_results):
    spec = BY_ID[case]
    for r in world_results(world)[case]:
        per_layer = {"_allgather_base_": 1, "alltoall_base_": 1} if world > 1 else {}  # queries in, (out, lse) back
        assert r["attend_ops"] == [per_layer] * (spec.layers * len(spec.chunks))
        assert r["next_chunk_ops"] == {"_allgather_base_": 1}  # the one agreement per chunk
        assert r["gather_ops"] == {"_allgather_base_": 2 if world > 1 else 1}  # agreement + the all-gather
        assert r["syncs"] == 0


@pytest.mark.parametrize(("world", "case"), CASES, ids=[f"cp{w}-{c}" for w, c in CASES])
def test_cache_shards_stay_within_one_token(world, case, world_results):
    spec = BY_ID[case]
    r = world_results(world)[case][0]
    assert r["shares"] == [tuple(chunk_shares(sum(spec.chunks[:c]), n, world)) for c, n in enumerate(spec.chunks)]
    for c, lengths in enumerate(r["lengths"]):
        kept = spec.chunks[: c + 1] if spec.window is None else spec.chunks[max(0, c + 1 - spec.window) : c + 1]
        assert sum(lengths) == sum(kept) and max(lengths) - min(lengths) <= 1, lengths
    if spec.capacity:
        assert (r["reallocations"], r["capacity"]) == (spec.layers, spec.capacity)  # allocated once per layer
    if spec.window is not None and len(spec.chunks) > 10:  # evicted tokens are compacted away, not kept
        live = -(-(spec.window + 1) * max(spec.chunks) // world)  # a rank's tokens of the window and the chunk
        assert r["capacity"] <= 2 * live < sum(spec.chunks) // world


def test_a_rank_can_hold_no_token_of_a_chunk(world_results):
    r = world_results(4)[SPECS[0].id][0]
    assert r["shares"] == [(2, 1, 1, 1), (0, 1, 1, 1), (2, 2, 2, 2)]
    assert world_results(4)[SPECS[4].id][3]["shares"][0] == (1, 1, 1, 0)


def test_chunk_shares_rotate_the_remainder():
    assert chunk_shares(0, 5, 4) == [2, 1, 1, 1]
    assert chunk_shares(5, 3, 4) == [0, 1, 1, 1]
    assert chunk_shares(8, 8, 4) == [2, 2, 2, 2]
    dealt = 0
    totals = [0] * 3
    for n in (1, 2, 7, 5, 3, 1, 1):
        totals = [t + s for t, s in zip(totals, chunk_shares(dealt, n, 3))]
        dealt += n
        assert max(totals) - min(totals) <= 1 and sum(totals) == dealt


# ---- errors: raised on every rank, naming the values ---------------------------------------------------
def make(pm, layers=3, **kwargs):
    return wf_mesh.KVCache(mesh=pm, layers=layers, batch=1, heads=2, head_dim=D, **kwargs)


def qkv(step, dtype=torch.float32, length=None):
    g = torch.Generator().manual_seed(step.index)
    return [torch.randn(1, 2, step.local_len if length is None else length, D, generator=g, dtype=dtype) for _ in "qkv"]


def outcome(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def misuse(kind):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    rank = pm.rank("cp")
    with torch.no_grad():
        if kind == "construct":
            return outcome(lambda: make(pm, layers=3 + rank))
        cache = make(pm)
        if kind == "chunk_len":
            return outcome(lambda: cache.next_chunk(3 + rank))
        if kind == "chunk_len_zero":
            return outcome(lambda: cache.next_chunk(0))
        step = cache.next_chunk(5)
        if kind == "layer_range":
            return outcome(lambda: step.attend(5, *qkv(step)))
        if kind == "skip":
            step.attend(0, *qkv(step))
            return outcome(lambda: step.attend(1 + 1, *qkv(step)))
        if kind == "twice":
            step.attend(0, *qkv(step))
            return outcome(lambda: step.attend(0, *qkv(step)))
        if kind == "shape":  # the whole chunk instead of this rank's shard
            return outcome(lambda: step.attend(0, *qkv(step, length=5)))
        if kind == "dtype":
            return outcome(lambda: step.attend(0, *qkv(step, torch.float64)))
        if kind == "gather":
            return outcome(lambda: step.gather(torch.zeros(1, 5), 1))
        if kind == "stale":
            for i in range(3):
                step.attend(i, *qkv(step))
            cache.next_chunk(2)
            return outcome(lambda: step.attend(0, *qkv(step)))
        if kind == "incomplete":  # layer 1 never attends: the next chunk refuses, the cache is rolled back
            step.attend(0, *qkv(step))
            error = outcome(lambda: cache.next_chunk(2))
            return error, cache.lengths, cache.chunks
    if kind == "grad":
        return outcome(lambda: step.attend(0, *(x.requires_grad_() for x in qkv(step))))
    raise AssertionError(kind)


MISUSES = {  # kind: (type, message on every rank)
    "construct": (DisagreementError, r"^KVCache: ranks disagree on layers \(rank 0: 3; rank 1: 4\)"),
    "chunk_len": (DisagreementError, r"^KVCache.next_chunk: ranks disagree on chunk length \(rank 0: 3; rank 1: 4\)"),
    "chunk_len_zero": (ValueError, r"^KVCache.next_chunk: chunk_len=0 must be >= 1$"),
    "layer_range": (ValueError, r"^layer=5: the cache has layers 0 \.\. 2$"),
    "skip": (ValueError, r"^layer=2 out of order: chunk 0's step attended layers 0 \.\. 0, so layer 1 comes next"),
    "twice": (ValueError, r"^layer=0 attended twice in chunk 0's step \(layer 1 comes next\)$"),
    "shape": (
        ShapeMismatchError,
        r"^q \(1, 2, 5, 4\) is not this rank's shard \(B, H, S, D\) = \(1, 2, [23], 4\) of chunk 0",
    ),
    "dtype": (TypeError, r"^q is torch.float64; the cache holds torch.float32$"),
    "gather": (
        ShapeMismatchError,
        r"^KVCacheStep.gather: rank 0: dim 1 of y \(1, 5\) has 5 tokens; this rank holds 3 of chunk 0 \(shares "
        r"\[3, 2\]\); rank 1: .* holds 2 of chunk 0",
    ),
    "stale": (StateError, r"^chunk 0's step is not the cache's current one"),
    "grad": (ValueError, r"^q requires grad: KVCache is inference only; decode under torch.no_grad\(\)"),
}


@pytest.fixture(scope="module")
def misuse_results():
    kinds = [*MISUSES, "incomplete"]
    per_rank = run_distributed(2, run_misuses, kinds)
    return {k: [r[i] for r in per_rank] for i, k in enumerate(kinds)}


def run_misuses(kinds):
    out = []
    for kind in kinds:
        out.append(misuse(kind))
        wf_mesh.get_parallel_mesh().destroy()
    return out


@pytest.mark.parametrize("kind", list(MISUSES))
def test_misuse_raises_on_every_rank_naming_the_values(kind, misuse_results):
    error, match = MISUSES[kind]
    raised_everywhere(misuse_results[kind], error, match)


def test_a_step_that_skipped_its_last_layer_is_refused_and_rolled_back(misuse_results):
    for error, lengths, chunks in misuse_results["incomplete"]:
        assert isinstance(error, StateError)
        assert str(error).startswith(
            "KVCache.next_chunk: chunk 0's step attended layers 0 .. 0 of 3 (layer 1 and later were never called)"
        )
        assert (lengths, chunks) == ((0, 0), 0)


# ---- fault containment: a failure on one rank raises on every rank; the chunk can be retried -------------
def contained(case):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()), contain_faults=True)
    rank = pm.rank("cp")
    spec = Spec((3, 5), heads=2, kv_heads=2, layers=2)
    layers, x = weights(spec)
    cache = wf_mesh.KVCache(mesh=pm, layers=2, batch=B, heads=2, head_dim=D, dtype=torch.float64)
    outputs, errors = [], []
    start = 0
    with torch.no_grad():
        for length in spec.chunks:
            chunk = x[:, start : start + length]
            start += length
            step = cache.next_chunk(length)
            if case == "shape" and step.index == 1:  # rank 1 alone passes a wrong shard: every rank raises
                bad = lambda i, q, k, v: step.attend(i, *(t[:, :, :1] if rank == 1 else t for t in (q, k, v)))
                errors.append(outcome(lambda: forward(spec, layers, step.shard(chunk, 1), bad)))
                step = cache.next_chunk(length)  # the failed step is rolled back: retry the chunk
            if case == "fault" and step.index == 1:
                fault = injected_fault("local attention of layer", 2, MemoryError("simulated")) if rank == 0 else None
                with fault or contextlib.nullcontext():
                    errors.append(outcome(lambda: forward(spec, layers, step.shard(chunk, 1), step.attend)))
                step = cache.next_chunk(length)
            outputs.append(step.gather(forward(spec, layers, step.shard(chunk, 1), step.attend), 1))
    return errors, torch.cat(outputs, 1), cache.lengths


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("shape", ShapeMismatchError, r"^KVCache.attend: rank 1: failed at validation of layer 1 of 2: "
                                      r"ShapeMismatchError: q \(2, 2, 1, 4\) is not this rank's shard"),
        ("fault", MemoryError, r"^KVCache.attend: rank 0: failed at local attention of layer 2 of 2: MemoryError: "
                               r"simulated \(raised on every rank of the group \[0, 1\]\)$"),
    ],
)  # fmt: skip
def test_a_contained_failure_on_one_rank_raises_on_every_rank_and_the_chunk_retries(case, error, match):
    results = run_distributed(2, contained, case)
    raised_everywhere([errors[0] for errors, _, _ in results], error, match)
    want = dense_reference(Spec((3, 5), heads=2, kv_heads=2, layers=2))
    for _, got, lengths in results:
        assert close(got, want, 1e-10)
        assert lengths == (4, 4)
