"""Context parallel: native shard/gather/broadcast_shard and the legacy CP functions, on real gloo groups,
compared with single-process references computed in the same test."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import wf_mesh
from wf_mesh import parallel_state as ps
from wf_mesh.errors import (
    DisagreementError,
    IndivisibleSequenceError,
    ShapeMismatchError,
    StateError,
)
from wf_mesh.sizing import chunk_sizes
from wf_mesh.testing import run_distributed

from helpers import raised_everywhere, sample


# ---- round trips -------------------------------------------------------------------------------------
def round_trip(tp, cp, pp, shape, seq_dim):
    wf_mesh.initialize_model_parallel(tp_size=tp, cp_size=cp, pp_size=pp)
    x = sample(shape)
    with CommDebugMode() as split_comm:
        dt = wf_mesh.shard_sequence(x, seq_dim, as_dtensor=True)
    with CommDebugMode() as gather_comm:
        full = wf_mesh.gather_sequence(dt)
    local = dt.to_local()
    full_from_local = wf_mesh.gather_sequence(local, seq_dim, seq_len=x.shape[seq_dim])
    return {
        "local": local,
        "placements": str(dt.placements),
        "global_shape": tuple(dt.shape),
        "full_equal": torch.equal(full, x),
        "from_local_equal": torch.equal(full_from_local, x),
        "split_collectives": split_comm.get_total_counts(),
        "gather_collectives": gather_comm.get_total_counts(),
        "cp_rank": ps.get_cp_rank(),
    }


CASES = [
    (4, (2, 2, 1), (6, 8, 3), 0),
    (4, (2, 2, 1), (2, 10, 3), 1),
    (4, (1, 4, 1), (2, 3, 12), -1),
    (4, (1, 4, 1), (2, 7, 3), 1),  # uneven: chunk sizes 2, 2, 2, 1
    (4, (1, 4, 1), (2, 3, 3), 1),  # uneven with an empty last shard: 1, 1, 1, 0
    (8, (2, 2, 2), (2, 9, 4), -2),  # cp 2 inside tp 2 x pp 2
    (8, (1, 4, 1), (5, 16, 2), 1),  # cp 4 inside dp 2
    (8, (1, 2, 2), (5, 3, 2), 1),  # uneven cp 2 inside pp 2 x dp 2
]


@pytest.mark.parametrize("world, degrees, shape, seq_dim", CASES)
def test_split_gather_round_trip_is_exact(world, degrees, shape, seq_dim):
    tp, cp, pp = degrees
    x = sample(shape)
    dim = seq_dim % len(shape)
    expected = torch.chunk(x, cp, dim)
    for out in run_distributed(world, round_trip, tp, cp, pp, shape, seq_dim):
        r = out["cp_rank"]
        want = expected[r] if r < len(expected) else x.narrow(dim, 0, 0)
        assert torch.equal(out["local"], want)
        assert out["placements"] == f"(Shard(dim={dim}),)" and out["global_shape"] == shape
        assert out["full_equal"] and out["from_local_equal"]
        assert out["split_collectives"] == 0 and out["gather_collectives"] == 2  # agreement + all-gather


# ---- gradients ---------------------------------------------------------------------------------------
def weights_for(rank, shape):
    return sample(shape, seed=100 + rank)


def gather_grads(shape, seq_dim, rule):
    wf_mesh.initialize_model_parallel(cp_size=dist.get_world_size())
    x = sample(shape)
    local = wf_mesh.shard_sequence(x, seq_dim).detach().requires_grad_()
    full = wf_mesh.gather_sequence(local, seq_dim, seq_len=x.shape[seq_dim], grad=rule)
    if rule == "replicate":  # every rank computes the same loss
        loss = (full.sin() * weights_for(0, shape)).sum()
    else:  # ranks use the gathered tensor differently (all-gathered K/V)
        loss = (full.sin() * weights_for(dist.get_rank(), shape)).sum()
    loss.backward()
    return local.grad


@pytest.mark.parametrize("rule", ["replicate", "partial"])
@pytest.mark.parametrize("world, shape, seq_dim", [(2, (3, 8, 2), 1), (4, (2, 3, 10), -1), (4, (7, 2), 0)])
def test_gradients_match_single_process(rule, world, shape, seq_dim):
    x = sample(shape).requires_grad_()
    ranks = [0] if rule == "replicate" else range(world)
    sum((x.sin() * weights_for(r, shape)).sum() for r in ranks).backward()
    expected = torch.chunk(x.grad, world, seq_dim)
    grads = run_distributed(world, gather_grads, shape, seq_dim, rule)
    for r, grad in enumerate(grads):
        assert torch.allclose(grad, expected[r], rtol=1e-6, atol=1e-6), (rule, r)


def partial_rule_collectives():
    wf_mesh.initialize_model_parallel(cp_size=2)
    local = torch.ones(2, 3, requires_grad=True)
    full = wf_mesh.gather_sequence(local, 0, grad="partial")
    with CommDebugMode() as comm:
        full.sum().backward()
    return {str(k): v for k, v in comm.get_comm_counts().items()}


def test_partial_rule_backward_is_one_reduce_scatter():
    for counts in run_distributed(2, partial_rule_collectives):
        assert sum(counts.values()) == 1 and "reduce_scatter" in next(iter(counts)), counts


# ---- DTensor in, DTensor out -------------------------------------------------------------------------
def dtensor_paths():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    x = sample((2, 6))
    dt = wf_mesh.shard_sequence(x, 1, mesh=mesh, as_dtensor=True)  # a ParallelMesh resolves to its cp axis
    again = wf_mesh.shard_sequence(wf_mesh.gather_sequence(dt), 1, mesh=mesh["cp"], as_dtensor=True)
    replicated = DTensor.from_local(x, mesh["cp"], [Replicate()])
    resharded = wf_mesh.shard_sequence(replicated, -1, as_dtensor=True)  # a DTensor input is redistributed
    return (
        isinstance(dt, DTensor),
        torch.equal(again.to_local(), dt.to_local()),
        resharded.placements == (Shard(1),) and torch.equal(resharded.to_local(), dt.to_local()),
    )


def test_dtensor_paths():
    assert run_distributed(2, dtensor_paths) == [(True, True, True)] * 2


# ---- legacy functions --------------------------------------------------------------------------------
def legacy_on_cp_group(shape, seq_dim):
    wf_mesh.initialize_model_parallel(tp_size=2, cp_size=2)  # cp groups [0, 2] and [1, 3]
    group = ps.get_cp_group()
    x = sample(shape)
    local = wf_mesh.split_inputs_cp(x, seq_dim, group)
    cat = wf_mesh.cat_outputs_cp(local, seq_dim, group)
    leaf = local.clone().requires_grad_()
    cat_grad = wf_mesh.cat_outputs_cp_with_grad(leaf, seq_dim, group)
    (cat_grad * sample(shape, seed=7)).sum().backward()
    with CommDebugMode() as split_comm:
        wf_mesh.split_inputs_cp(x, seq_dim, group)
    source = x if dist.get_rank() in (0, 1) else None  # receivers may pass None
    shard = wf_mesh.broadcast_split_tensor(source, seq_dim, group)
    wf_mesh.split_inputs_cp(x, seq_dim, group).add_(1)  # the legacy split is a new tensor, never a view of x
    untouched = torch.equal(x, sample(shape))
    return {
        "local": local,
        "cat": cat,
        "cat_requires_grad": cat.requires_grad,
        "cat_grad_values": cat_grad.detach(),
        "leaf_grad": leaf.grad,
        "split_collectives": split_comm.get_total_counts(),
        "shard": shard,
        "mesh_is_cp_axis": wf_mesh.mesh_for_group(group) is wf_mesh.get_parallel_mesh()["cp"],
        "input_untouched": untouched,
    }


@pytest.mark.parametrize("shape, seq_dim", [((2, 8, 3), 1), ((4, 3), -2), ((2, 3, 6), -1)])
def test_legacy_functions_on_a_real_cp_group(shape, seq_dim):
    x = sample(shape)
    upstream = sample(shape, seed=7)
    for rank, out in enumerate(run_distributed(4, legacy_on_cp_group, shape, seq_dim)):
        cp_rank = rank // 2  # groups [0, 2], [1, 3]: ranks 1 and 3 form a group whose smallest rank is 1
        assert torch.equal(out["local"], torch.chunk(x, 2, seq_dim)[cp_rank])
        assert torch.equal(out["cat"], x) and not out["cat_requires_grad"]
        assert torch.equal(out["cat_grad_values"], x)
        assert torch.equal(out["leaf_grad"], torch.chunk(upstream, 2, seq_dim)[cp_rank])
        assert out["split_collectives"] == 0
        assert torch.equal(out["shard"], torch.chunk(x, 2, seq_dim)[cp_rank])
        assert out["mesh_is_cp_axis"] and out["input_untouched"]


def legacy_on_new_group():
    group = dist.new_group([1, 3])  # collective: every rank calls it
    if dist.get_rank() not in (1, 3):
        return None
    x = sample((2, 4)) * (dist.get_rank() + 1)  # different on each rank: only the source's matters
    return {
        "split": wf_mesh.split_inputs_cp(x, 1, group),
        "cat": wf_mesh.cat_outputs_cp(x, 1, group),
        "shard": wf_mesh.broadcast_split_tensor(x, 1, group),
        "bcast": wf_mesh.broadcast(x, group),
        "text": wf_mesh.broadcast(f"from rank {dist.get_rank()} ✓", group),
        "none": wf_mesh.broadcast(None, group),
    }


def test_legacy_group_whose_smallest_rank_is_not_0():
    out = run_distributed(4, legacy_on_new_group)
    assert out[0] is None and out[2] is None
    x1, x3 = sample((2, 4)) * 2, sample((2, 4)) * 4
    assert torch.equal(out[1]["split"], x1[:, :2]) and torch.equal(out[3]["split"], x3[:, 2:])
    for r in (1, 3):
        assert torch.equal(out[r]["cat"], torch.cat([x1, x3], 1))
        assert torch.equal(out[r]["bcast"], x1)  # the source is rank 1, the group's smallest rank
        assert out[r]["text"] == "from rank 1 ✓" and out[r]["none"] is None
    assert torch.equal(out[1]["shard"], x1[:, :2]) and torch.equal(out[3]["shard"], x1[:, 2:])


def test_none_group_and_single_process_identity():
    x = torch.arange(24).reshape(2, 3, 4)
    for fn in (
        wf_mesh.split_inputs_cp,
        wf_mesh.cat_outputs_cp,
        wf_mesh.cat_outputs_cp_with_grad,
        wf_mesh.broadcast_split_tensor,
    ):
        assert fn(x, 1, None) is x
    assert wf_mesh.broadcast(x, None) is x and wf_mesh.broadcast("s", None) == "s"
    assert wf_mesh.broadcast(None) is None


def one_rank_group():
    group = dist.new_group([dist.get_rank()]) if dist.get_world_size() == 1 else None
    x = torch.ones(2, 3)
    return all(fn(x, 1, group) is x for fn in (wf_mesh.split_inputs_cp, wf_mesh.cat_outputs_cp))


def test_one_rank_group_returns_input():
    assert run_distributed(1, one_rank_group) == [True]


# ---- broadcast ---------------------------------------------------------------------------------------
def broadcast_kinds():
    wf_mesh.initialize_model_parallel(cp_size=2, tp_size=2)  # cp groups [0, 2], [1, 3]
    group = ps.get_cp_group()
    rank = dist.get_rank()
    t = torch.full((2, 3), float(rank), dtype=torch.bfloat16)
    out = {"tensor": wf_mesh.broadcast(t, group), "text": wf_mesh.broadcast("é" * rank, group)}
    out["src_identity"] = wf_mesh.broadcast(t, group) is t
    out["empty"] = wf_mesh.broadcast(torch.empty(0, 4), group).shape
    return out


def test_broadcast_tensor_and_str_from_smallest_rank():
    out = run_distributed(4, broadcast_kinds)
    for rank, o in enumerate(out):
        src = rank % 2
        assert torch.equal(o["tensor"], torch.full((2, 3), float(src), dtype=torch.bfloat16))
        assert o["text"] == "é" * src
        assert o["src_identity"] == (rank == src)
        assert o["empty"] == torch.Size([0, 4])


# ---- errors on every rank ----------------------------------------------------------------------------
def misuse(case):
    """One rank (or every rank) calls a CP function wrongly; every rank must raise the same error."""
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    group, rank = mesh.group("cp"), dist.get_rank()
    x, x3 = torch.zeros(2, 4), torch.zeros(2, 4, 4)
    calls = {
        "cat_shape": lambda: wf_mesh.cat_outputs_cp(torch.zeros(2, 3 + rank), 1, group),
        "cat_dtype": lambda: wf_mesh.cat_outputs_cp(x.to(torch.float32 if rank else torch.float16), 1, group),
        "seq_len_mismatch": lambda: wf_mesh.gather_sequence(x, 1, seq_len=8 if rank else 7),
        "seq_len_wrong": lambda: wf_mesh.gather_sequence(torch.zeros(2, 3), 1, seq_len=5),
        "seq_dim_out_of_range_on_one_rank": lambda: wf_mesh.gather_sequence(x, 5 if rank else 1),
        "seq_dim_differs": lambda: wf_mesh.gather_sequence(torch.zeros(4, 4), rank),
        "seq_dim_float": lambda: wf_mesh.gather_sequence(x, 1.0),
        "dtensor_and_plain": lambda: wf_mesh.gather_sequence(
            wf_mesh.shard_sequence(torch.zeros(2, 8), 1, as_dtensor=True) if rank else x, 1
        ),
        "split_seq_dim_differs": lambda: wf_mesh.broadcast_split_tensor(torch.zeros(4, 4), rank, group),
        "cat_seq_dim_differs": lambda: wf_mesh.cat_outputs_cp(torch.zeros(4, 4), rank, group),
        "split_indivisible": lambda: wf_mesh.split_inputs_cp(torch.zeros(2, 7), -1, group),
        "broadcast_split_indivisible": lambda: wf_mesh.broadcast_split_tensor(
            torch.zeros(9, 2) if rank == 0 else None, 0, group
        ),
        "bad_dim": lambda: wf_mesh.split_inputs_cp(x, 2, group),
        # gathered along another dim than it was sharded on: a (2, 2, 8) tensor, silently, before the record
        "shard_gathered_on_another_dim": lambda: wf_mesh.gather_sequence(wf_mesh.shard_sequence(x3, 1), 2),
        "one_rank_gathers_its_shard_on_another_dim": lambda: wf_mesh.gather_sequence(
            wf_mesh.shard_sequence(x3, 1) if rank else torch.zeros(2, 2, 4), 2
        ),
        "broadcast_shard_gathered_on_another_dim": lambda: wf_mesh.gather_sequence(
            wf_mesh.broadcast_shard(x3 if rank == 0 else None, 1), -1
        ),
        "dtensor_gathered_on_another_dim": lambda: wf_mesh.gather_sequence(
            wf_mesh.shard_sequence(x3, 1, as_dtensor=True), 2
        ),
    }
    return calls[case]()


MISUSE = {
    "cat_shape": (
        ShapeMismatchError,
        r"gather_sequence: local lengths along dim 1 \(rank 0: 3, rank 1: 4\) are not torch.chunk shards of a sequence of 7 over 2 ranks, which are \[4, 3\]",
    ),
    "cat_dtype": (
        ShapeMismatchError,
        r"ranks disagree on dtype and the dims other than seq_dim \(rank 0: torch.float16 \(2, '\*'\); rank 1: torch.float32 \(2, '\*'\)\)",
    ),
    "seq_len_mismatch": (DisagreementError, r"gather_sequence: ranks disagree on seq_len \(rank 0: 7; rank 1: 8\)"),
    "seq_len_wrong": (
        ShapeMismatchError,
        r"local lengths along dim 1 \(rank 0: 3, rank 1: 3\) are not torch.chunk shards of a sequence of 5 over 2 ranks, which are \[3, 2\]",
    ),
    "seq_dim_out_of_range_on_one_rank": (
        IndexError,
        r"gather_sequence: rank 1: seq_dim=5 is out of range for a tensor with 2 dims \(raised on every rank of the group \[0, 1\]\)",
    ),
    "seq_dim_differs": (DisagreementError, r"gather_sequence: ranks disagree on seq_dim \(rank 0: 0; rank 1: 1\)"),
    "seq_dim_float": (TypeError, r"gather_sequence: seq_dim must be an int, got float 1.0"),
    "dtensor_and_plain": (
        DisagreementError,
        r"ranks disagree on DTensor-or-plain input \(rank 0: plain tensor; rank 1: DTensor\)",
    ),
    "split_seq_dim_differs": (
        DisagreementError,
        r"broadcast_shard: ranks disagree on seq_dim \(rank 0: 0; rank 1: 1\)",
    ),
    "cat_seq_dim_differs": (DisagreementError, r"gather_sequence: ranks disagree on seq_dim \(rank 0: 0; rank 1: 1\)"),
    "split_indivisible": (
        IndivisibleSequenceError,
        r"split_inputs_cp: sequence length 7 \(seq_dim=-1\) is not divisible by the cp size 2",
    ),
    "broadcast_split_indivisible": (
        IndivisibleSequenceError,
        r"broadcast_split_tensor: sequence length 9 \(seq_dim=0\) is not divisible by the cp size 2",
    ),
    "bad_dim": (IndexError, r"seq_dim=2 is out of range for a tensor with 2 dims"),
    "shard_gathered_on_another_dim": (
        ValueError,
        r"^gather_sequence: seq_dim=2 but this tensor is a shard that shard_sequence made along dim 1 \(local "
        r"shape \(2, 2, 4\)\); gather it with seq_dim=1$",
    ),
    "one_rank_gathers_its_shard_on_another_dim": (
        ValueError,
        r"^gather_sequence: rank 1: seq_dim=2 but this tensor is a shard that shard_sequence made "
        r"along dim 1 .* \(raised on every rank of the group \[0, 1\]\)$",
    ),
    "broadcast_shard_gathered_on_another_dim": (
        ValueError,
        r"seq_dim=-1 but this tensor is a shard that broadcast_shard made along dim 1 \(local shape \(2, 2, 4\)\)",
    ),
    "dtensor_gathered_on_another_dim": (ValueError, r"seq_dim=2 but the DTensor is sharded on dim 1"),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_the_same_error_on_every_rank(case):
    error, match = MISUSE[case]
    messages = raised_everywhere(run_distributed(2, misuse, case, return_exceptions=True), error, match)
    if case != "bad_dim":  # split_inputs_cp has no collective: each rank raises its own message
        assert messages[0] == messages[1]


def records_that_do_not_apply():
    """The shard record refuses only a contradiction: a module's output, a shard changed in place, and the
    shard itself along its own dim all gather as before."""
    wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    x = sample((2, 4, 2))
    local = wf_mesh.shard_sequence(x, 1)  # (2, 2, 2)
    same = wf_mesh.gather_sequence(local, 1)
    output = wf_mesh.gather_sequence(torch.tanh(local).transpose(1, 2), 2)  # a new tensor: no record
    local.transpose_(1, 2)  # the same shape, the sequence now on dim 2: the record no longer describes it
    moved = wf_mesh.gather_sequence(local, 2)
    return same, output, moved, x


def test_a_shard_record_refuses_only_a_contradiction():
    for same, output, moved, x in run_distributed(2, records_that_do_not_apply):
        assert torch.equal(same, x)
        assert torch.equal(output, torch.tanh(x).transpose(1, 2))
        assert torch.equal(moved, x.transpose(1, 2))


def dtensor_on_another_mesh():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2, cp=2))
    tp_sharded = wf_mesh.shard_sequence(sample((2, 8)), 1, mesh=mesh["tp"], as_dtensor=True)
    outcomes = {}
    for name, call in {
        "gather": lambda: wf_mesh.gather_sequence(tp_sharded, mesh=mesh),
        "shard": lambda: wf_mesh.shard_sequence(tp_sharded, 1, mesh=mesh),
    }.items():
        try:
            call()
        except ValueError as e:
            outcomes[name] = str(e)
    stale = wf_mesh.shard_sequence(sample((2, 8)), 1, as_dtensor=True)
    wf_mesh.destroy_model_parallel()
    wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2, cp=2))
    try:
        wf_mesh.gather_sequence(stale)
    except StateError as e:
        outcomes["destroyed"] = str(e)
    return outcomes


def test_dtensor_on_another_mesh_or_a_destroyed_one_is_refused():
    for out in run_distributed(4, dtensor_on_another_mesh):
        assert "the DTensor lives on DeviceMesh((tp=2)" in out["gather"] and "not on the cp mesh" in out["gather"]
        assert "redistribute it onto the cp mesh first" in out["shard"]
        assert "belongs to a destroyed mesh (ParallelMesh.destroy)" in out["destroyed"]


def agreement_collectives():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
    x = sample((2, 6))
    dt = wf_mesh.shard_sequence(x, 1, as_dtensor=True)
    with CommDebugMode() as checked:
        wf_mesh.gather_sequence(dt)
    mesh.destroy()
    wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2), checks=False)
    dt = wf_mesh.shard_sequence(x, 1, as_dtensor=True)
    with CommDebugMode() as unchecked:
        full = wf_mesh.gather_sequence(dt)
    return checked.get_total_counts(), unchecked.get_total_counts(), torch.equal(full, x)


def test_agreement_is_one_small_exchange_and_checks_can_be_turned_off():
    assert run_distributed(2, agreement_collectives) == [(2, 1, True)] * 2


# ---- find_split ---------------------------------------------------------------------------------------
FIND_SPLIT = [
    ((1, 16, 24, 88, 160), 16, (3, 44, 160), 8),
    ((1, 16, 16, 88, 160), 8, (2, 88, 160), 8),
    ((1, 16, 24, 88, 160), 48, (1, 44, 160), 24),
    ((1, 16, 6, 88, 160), 4, (3, 44, 160), 2),
    ((1, 16, 21, 88, 160), 2, (21, 44, 160), 1),
]


@pytest.mark.parametrize("shape, cp, expected, cp_t", FIND_SPLIT)
def test_find_split_reference_values(shape, cp, expected, cp_t):
    assert wf_mesh.find_split(torch.Size(shape), cp) == torch.Size(expected)
    assert ps.cp_size_t == cp_t
    ps.destroy_model_parallel()  # nothing initialized: still resets cp_size_t
    assert not hasattr(ps, "cp_size_t")


def test_find_split_errors():
    with pytest.raises(
        ValueError,
        match=r"cannot split \(T=21, H=88, W=160\) with patch \(1, 2, 2\) over cp_size=8: "
        r"a factor 2 is left for W, which is never split",
    ):
        wf_mesh.find_split(torch.Size((1, 16, 21, 88, 160)), 8)
    with pytest.raises(AssertionError, match="T=21 is not divisible by view_factor=2"):
        wf_mesh.find_split((1, 16, 21, 88, 160), 2, view_factor=2)
    assert wf_mesh.find_split((1, 16, 24, 88, 160), 8, view_factor=2) == torch.Size((3, 44, 160))  # T = 24 // 2
    with pytest.raises(ValueError, match=r"expects a \(B, C, T, H, W\) shape, got \(16, 24, 88, 160\)"):
        wf_mesh.find_split((16, 24, 88, 160), 2)


def test_chunk_sizes_follow_torch_chunk():
    for length in range(0, 13):
        for parts in range(1, 6):
            sizes = [c.numel() for c in torch.chunk(torch.arange(length), parts)] if length else []
            assert chunk_sizes(length, parts) == sizes + [0] * (parts - len(sizes))


# ---- dtypes the backends cannot reduce travel as bytes -----------------------------------------------
def byte_round_trip(cp, dtype, shape, seq_dim):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=cp))
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)
    local = wf_mesh.shard_sequence(x, seq_dim, mesh=pm)
    plain = wf_mesh.gather_sequence(local, seq_dim, mesh=pm)
    dt = wf_mesh.gather_sequence(wf_mesh.shard_sequence(x, seq_dim, mesh=pm, as_dtensor=True))
    return [
        (out.dtype, tuple(out.shape), torch.equal(out.view(torch.uint8), x.view(torch.uint8))) for out in (plain, dt)
    ]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", sorted(wf_mesh.context_parallel.BYTE_DTYPES, key=str))
def test_gather_moves_dtypes_gloo_cannot_reduce_as_bytes(world, dtype):
    shape, seq_dim = (2, 7, 3), 1  # uneven over 2 and 4 ranks
    for rank_result in run_distributed(world, byte_round_trip, world, dtype, shape, seq_dim):
        assert rank_result == [(dtype, shape, True)] * 2


def gather_float8_requiring_grad(cp):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=cp))
    x = torch.zeros(2, 4, 3).to(torch.float8_e4m3fn).requires_grad_(True)
    wf_mesh.gather_sequence(x, 1, mesh=pm)


def test_gather_of_a_byte_dtype_requiring_grad_is_refused_everywhere():
    raised_everywhere(
        run_distributed(2, gather_float8_requiring_grad, 2, return_exceptions=True),
        TypeError,
        "moves torch.float8_e4m3fn as bytes, which carries no gradient",
    )
