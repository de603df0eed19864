"""Shard-local EMA: FSDP2 (1-D dp_cp and 2-D HSDP) on gloo against a single-process run, bf16 models,
swap/cache/restore round trips, DCP checkpoints across world sizes, and the error messages."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import wf_mesh
from wf_mesh import DTensorFastEmaModelUpdater, ShardedEMA, get_local_tensor_if_dtensor
from wf_mesh.testing import run_distributed

BETA = 0.9
STEPS = 3


class Net(nn.Module):
    """Root-level parameter (FSDP2 keeps the root unsharded after forward), uneven and empty shards at 4 ranks."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 7))
        self.blocks = nn.ModuleList([nn.Linear(7, 10), nn.Linear(10, 7)])
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        x = x * self.scale
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def make_net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return Net().to(dtype)


def shard(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_mesh(kind):
    """("fsdp": 1-D dp_cp of 4) or ("hsdp": 2 replicas x (dp_shard 1 x cp 2)); returns (mesh, shard index, shards)."""
    if kind == "fsdp":
        pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2))
        return pm.fsdp_mesh(), pm.rank("dp_cp"), pm.size("dp_cp")
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=2), dp_replicate=2)
    mesh = pm.hsdp_mesh()
    return mesh, mesh.get_local_rank("shard"), mesh.size(1)


def chunk(full, shards, index):
    """This rank's Shard(0) piece of ``full`` (torch.chunk sizing, as FSDP2 and DTensor shard)."""
    pieces = torch.chunk(full, shards, dim=0)
    return pieces[index] if index < len(pieces) else full[:0]


def batches(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world, 5, 7, generator=g), torch.randn(world, 5, 3, generator=g)


def locals_of(model):
    return {n: get_local_tensor_if_dtensor(p).detach().clone() for n, p in model.named_parameters()}


def max_diff(local, full, shards, index):
    return {
        n: (t.float() - chunk(full[n].float(), shards, index)).abs().max().item() if t.numel() else 0.0
        for n, t in local.items()
    }


# ---- FSDP2 / HSDP against a single-process run ---------------------------------------------------------
def fsdp_ema_run(kind, dtype):
    mesh, index, shards = build_mesh(kind)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_net(dtype=dtype)
    model = shard(copy.deepcopy(ref), mesh)
    ema = ShardedEMA(model, beta=BETA)
    ref_ema = {n: p.detach().float().clone() for n, p in ref.named_parameters()}
    gathered_ema = copy.deepcopy(ref_ema)  # bf16: EMA of the distributed model's own (gathered) weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        xs, ys = batches(step, world)
        nn.functional.mse_loss(model(xs[rank].to(dtype)).float(), ys[rank]).backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)
        # single process: the same global batch, loss averaged over ranks as FSDP averages gradients
        sum(nn.functional.mse_loss(ref(xs[r].to(dtype)).float(), ys[r]) for r in range(world)).div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                ref_ema[n].mul_(BETA).add_(p.float(), alpha=1 - BETA)
            for n, p in model.named_parameters():
                gathered_ema[n].mul_(BETA).add_(p.full_tensor().float(), alpha=1 - BETA)
    sd = ema.state_dict()
    return {
        "types": {
            n: (type(v).__name__, str(v.dtype), v.placements == p.placements, v.shape == p.shape)
            for (n, v), p in zip(sd.items(), model.parameters())
        },
        "ema_vs_single": max_diff({n: v.to_local() for n, v in sd.items()}, ref_ema, shards, index),
        "ema_vs_gathered": max_diff({n: v.to_local() for n, v in sd.items()}, gathered_ema, shards, index),
        "model_vs_single": max_diff(
            locals_of(model), {n: p.detach() for n, p in ref.named_parameters()}, shards, index
        ),
    }


@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_fsdp2_ema_equals_single_process_slice(kind):
    for rank, out in enumerate(run_distributed(4, fsdp_ema_run, kind, torch.float32)):
        assert set(out["types"]) == {
            "scale",
            "blocks.0.weight",
            "blocks.0.bias",
            "blocks.1.weight",
            "blocks.1.bias",
            "head.weight",
            "head.bias",
        }
        assert all(t == ("DTensor", "torch.float32", True, True) for t in out["types"].values()), out["types"]
        assert max(out["model_vs_single"].values()) < 1e-5, (rank, out["model_vs_single"])
        assert max(out["ema_vs_single"].values()) < 1e-5, (rank, out["ema_vs_single"])
        assert max(out["ema_vs_gathered"].values()) < 1e-6, (rank, out["ema_vs_gathered"])


@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_bf16_model_fp32_ema(kind):
    for rank, out in enumerate(run_distributed(4, fsdp_ema_run, kind, torch.bfloat16)):
        assert all(t == ("DTensor", "torch.float32", True, True) for t in out["types"].values()), out["types"]
        # exact EMA arithmetic on the model's own bf16 weights ...
        assert max(out["ema_vs_gathered"].values()) < 1e-6, (rank, out["ema_vs_gathered"])
        # ... and the same run in one process, up to bf16 rounding of differently ordered gradient sums
        assert max(out["ema_vs_single"].values()) < 3e-2, (rank, out["ema_vs_single"])


# ---- swap / legacy cache-copy_to-restore round trips ------------------------------------------------------
def round_trips():
    mesh, _, _ = build_mesh("hsdp")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_net()
    model = shard(copy.deepcopy(ref), mesh)
    ema_model = shard(copy.deepcopy(ref), mesh)  # legacy: a second, float32, identically sharded model
    ema = ShardedEMA(model, beta=BETA)
    updater = DTensorFastEmaModelUpdater()
    updater.copy_to(model, ema_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        xs, ys = batches(step, world)
        nn.functional.mse_loss(model(xs[rank]), ys[rank]).backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)
        updater.update_average(model, ema_model, beta=BETA)
    out = {}
    native = {n: v.to_local() for n, v in ema.state_dict().items()}
    legacy = locals_of(ema_model)
    out["legacy_equals_native"] = all(torch.equal(native[n], legacy[n]) for n in native)
    training = locals_of(model)
    x = batches(99, world)[0][0]
    full_ema = {n: p.full_tensor() for n, p in ema.state_dict().items()}
    ema_ref = copy.deepcopy(ref)
    ema_ref.load_state_dict(full_ema)
    train_ref = copy.deepcopy(ref)
    train_ref.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})

    with ema.swapped_into(model):
        inside = locals_of(model)
        out["swap_inside_is_ema"] = all(torch.equal(inside[n], native[n]) for n in native)
        out["swap_forward"] = (model(x) - ema_ref(x)).abs().max().item()  # root stays unsharded after this
    after = locals_of(model)
    out["swap_restores_exactly"] = all(torch.equal(after[n], training[n]) for n in training)
    out["forward_after_swap"] = (model(x) - train_ref(x)).abs().max().item()  # gathers the restored shards
    model.reshard()

    updater.cache(model.parameters())
    try:
        updater.cache(model.parameters())
    except RuntimeError as e:
        out["cache_twice"] = str(e)
    updater.copy_to(ema_model, model)
    now = locals_of(model)
    out["copy_to_is_ema"] = all(torch.equal(now[n], legacy[n]) for n in legacy)
    out["legacy_forward"] = (model(x) - ema_ref(x)).abs().max().item()
    model.reshard()
    updater.restore(model.parameters())
    after = locals_of(model)
    out["restore_exact"] = all(torch.equal(after[n], training[n]) for n in training)
    out["is_cached"] = updater.is_cached
    try:
        updater.restore(model.parameters())
    except RuntimeError as e:
        out["restore_uncached"] = str(e)
    return out


def test_swap_and_cache_copy_to_restore_round_trips():
    for out in run_distributed(4, round_trips):
        assert out["legacy_equals_native"]  # the legacy class is the same code
        assert out["swap_inside_is_ema"] and out["swap_restores_exactly"]
        assert out["swap_forward"] < 1e-5 and out["forward_after_swap"] < 1e-5
        assert out["copy_to_is_ema"] and out["legacy_forward"] < 1e-5
        assert out["restore_exact"] and not out["is_cached"]
        assert out["cache_twice"] == "EMA cache is already taken. Did you forget to restore it?"
        assert out["restore_uncached"].startswith("EMA cache is not taken: call cache(parameters) before restore")


# ---- FSDP2 modules in whatever state a forward left them --------------------------------------------------
def after_forward():
    mesh, _, _ = build_mesh("fsdp")
    model = shard(make_net(), mesh)
    ema = ShardedEMA(model, beta=0.5)
    training = locals_of(model)
    out = {}
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.eval()
        before = model(x)  # eval forward: the root (it owns "scale") keeps its parameters unsharded
    with ema.swapped_into(model):  # no manual reshard needed
        out["inside_is_ema"] = all(torch.equal(v, ema.state_dict()[n].to_local()) for n, v in locals_of(model).items())
        with torch.no_grad():
            model(x)  # a forward inside leaves the EMA weights unsharded again
    out["restored_exactly"] = all(torch.equal(locals_of(model)[n], v) for n, v in training.items())
    with torch.no_grad():
        out["forward_after_swap_equal"] = torch.equal(model(x), before)
    model.train()
    model(x).sum()  # training forward, no backward yet: unsharded root again
    ema.update(model)  # resharded first, then the EMA reads shards
    out["ema_still_equals_weights"] = all(torch.equal(ema.state_dict()[n].to_local(), v) for n, v in training.items())
    legacy = DTensorFastEmaModelUpdater()
    target = shard(make_net(seed=1), mesh)
    legacy.update_average(model, target, beta=0.0)  # unsharded source: resharded too
    out["legacy_copied"] = all(torch.equal(locals_of(target)[n], v) for n, v in training.items())
    plain = make_net()  # same parameters, not sharded: the shard shapes differ
    try:
        DTensorFastEmaModelUpdater().copy_to(plain, model)
    except ValueError as e:
        out["shape"] = str(e)
    return out


def test_ema_swaps_and_updates_whatever_state_a_forward_left():
    for rank, out in enumerate(run_distributed(2, after_forward)):
        assert out["inside_is_ema"] and out["restored_exactly"] and out["forward_after_swap_equal"]
        assert out["ema_still_equals_weights"] and out["legacy_copied"]
        assert out["shape"] == (  # 'scale' has 7 elements: shards of 4 and 3
            f"copy_to: the local shard of source parameter 'scale' has shape (7,) but target parameter 'scale' has "
            f"({4 - rank},); both must hold the same parameters, sharded the same way (same fully_shard calls, same mesh)"
        )


def test_ema_matches_parameters_by_name_and_follows_dtype_changes():
    model = nn.Sequential(nn.Linear(3, 2))
    ema = ShardedEMA(model, beta=0.5)
    renamed = nn.Sequential()
    renamed.add_module("proj", nn.Linear(3, 2))  # same count and shapes, other names
    with pytest.raises(ValueError, match="the model has parameter 'proj.weight' where the EMA has '0.weight'"):
        ema.update(renamed)
    model.half()  # same Parameter objects, new dtype: the EMA plans again and stays float32
    ema.update(model)
    assert all(v.dtype == torch.float32 for v in ema.state_dict().values())
    with pytest.raises(TypeError, match="EMA beta must be a float in \\[0, 1\\], got str '0.9'"):
        ShardedEMA(model, beta="0.9")
    with pytest.raises(TypeError, match="ShardedEMA.load_state_dict: '0.bias' is a list, not a tensor or DTensor"):
        ema.load_state_dict({"0.weight": torch.zeros(2, 3), "0.bias": [0.0, 0.0]})


def test_ema_retries_only_after_its_plans_went_stale():
    """A parameter that changed dtype in place makes the foreach kernel fail: the EMA plans again and applies
    once more. Any other error, out of memory above all, propagates from the one attempt."""
    model = nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    ema = ShardedEMA(model, beta=0.5)
    model.double()  # same Parameter objects, float64 data: the plans are stale
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    for (name, value), p0 in zip(ema.state_dict().items(), start):
        assert value.dtype == torch.float32 and torch.allclose(value, p0 + 0.5), name

    attempts = []

    def out_of_memory():
        attempts.append("oom")
        raise torch.OutOfMemoryError("out of memory: tried to allocate 2.00 GiB")

    def other_failure():
        attempts.append("other")
        raise RuntimeError("a kernel failed for another reason")

    model.half()  # stale again: even then an out-of-memory error is not retried
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 2.00 GiB"):
        ema._run(model, "update", out_of_memory)
    fresh = ShardedEMA(model, beta=0.5)  # planned for the float16 model
    with pytest.raises(RuntimeError, match="another reason"):
        fresh._run(model, "update", other_failure)  # the plans fit: nothing to plan again, the error propagates
    assert attempts == ["oom", "other"]


def test_ema_and_the_legacy_updater_do_not_keep_models_alive():
    import gc
    import weakref

    model, target = nn.Linear(3, 2), nn.Linear(3, 2)
    ema, legacy = ShardedEMA(model), DTensorFastEmaModelUpdater()
    legacy.update_average(model, target)
    refs = [weakref.ref(model), weakref.ref(target)]
    del model, target
    gc.collect()
    assert [r() for r in refs] == [None, None] and len(ema) == 2 and not legacy._pairs


# ---- torch.distributed.checkpoint ------------------------------------------------------------------------
def save_ema(path):
    mesh, _, _ = build_mesh("fsdp")
    model = shard(make_net(), mesh)
    ema = ShardedEMA(model, beta=BETA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        xs, ys = batches(step, dist.get_world_size())
        nn.functional.mse_loss(model(xs[dist.get_rank()]), ys[dist.get_rank()]).backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)
    dcp.save(ema.state_dict(), checkpoint_id=path)
    return {n: v.full_tensor() for n, v in ema.state_dict().items()}


def load_ema(path):
    pm = wf_mesh.init_parallel()
    model = shard(make_net(seed=dist.get_rank() + 7), pm.fsdp_mesh())  # different weights: the load must win
    ema = ShardedEMA(model)
    state = ema.state_dict()
    dcp.load(state, checkpoint_id=path)
    ema.load_state_dict(state)
    return {n: v.full_tensor() for n, v in ema.state_dict().items()}, type(state["scale"]).__name__


def test_dcp_checkpoint_saved_at_4_loads_at_2_and_4(tmp_path):
    saved = run_distributed(4, save_ema, str(tmp_path))[0]
    for world in (2, 4):
        for loaded, kind in run_distributed(world, load_ema, str(tmp_path)):
            assert kind == "DTensor"
            assert set(loaded) == set(saved)
            for name in saved:
                assert torch.equal(loaded[name], saved[name]), (world, name)


# ---- single process: plain modules, legacy API, errors --------------------------------------------------
def test_plain_module_ema_update_swap_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    ema = ShardedEMA(model, beta=0.5)
    expected = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        for n, p in model.named_parameters():
            expected[n] = 0.5 * expected[n] + 0.5 * p.detach().float()
    sd = ema.state_dict()
    assert list(sd) == [n for n, _ in model.named_parameters()]
    for n, v in sd.items():
        assert v.dtype == torch.float32 and not isinstance(v, DTensor)
        torch.testing.assert_close(v, expected[n], rtol=0, atol=1e-6)
    training = [p.detach().clone() for p in model.parameters()]
    with ema.swapped_into(model) as m:
        assert m is model
        for p, n in zip(model.parameters(), sd):
            assert torch.equal(p, sd[n].to(torch.bfloat16))
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), training))
    ema.update(model, beta=0.0)  # beta=0: the EMA becomes the weights
    assert all(torch.equal(ema.state_dict()[n], p.float()) for n, p in model.named_parameters())
    assert repr(ema) == "ShardedEMA(beta=0.5, parameters=4, local_elements=23)"


def test_plain_module_params_replaced_are_picked_up():
    model = nn.Linear(3, 2)
    ema = ShardedEMA(model, beta=0.0)
    model.load_state_dict({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, assign=True)  # new Parameters
    ema.update(model)
    assert torch.equal(ema.state_dict()["weight"], torch.ones(2, 3))
    other = nn.Linear(3, 2)
    ema.update(other)  # another model of the same layout: rebinds
    assert torch.equal(ema.state_dict()["weight"], other.weight.detach())


def test_legacy_updater_on_plain_modules():
    torch.manual_seed(0)
    src, tgt = nn.Linear(4, 3), nn.Linear(4, 3)
    updater = DTensorFastEmaModelUpdater()
    updater.copy_to(src, tgt)
    assert torch.equal(tgt.weight, src.weight)
    with torch.no_grad():
        src.weight.add_(1.0)
    expected = 0.9999 * tgt.weight.detach() + 0.0001 * src.weight.detach()
    updater.update_average(src, tgt)
    torch.testing.assert_close(tgt.weight.detach(), expected, rtol=0, atol=1e-7)
    half = copy.deepcopy(src).to(torch.bfloat16)
    expected = 0.5 * tgt.weight.detach() + 0.5 * half.weight.detach().float()
    updater.update_average(half, tgt, beta=0.5)  # bf16 source, fp32 target: mul + add
    assert tgt.weight.dtype == torch.float32
    torch.testing.assert_close(tgt.weight.detach(), expected, rtol=0, atol=1e-7)
    training = [p.detach().clone() for p in tgt.parameters()]
    updater.cache(tgt.parameters(), is_cpu=True)
    assert all(c.device.type == "cpu" for c in updater.collected_params)
    with torch.no_grad():
        for p in tgt.parameters():
            p.zero_()
    updater.restore(tgt.parameters())
    assert all(torch.equal(p, t) for p, t in zip(tgt.parameters(), training))
    updater.cache(tgt.parameters())
    updater.restore(list(tgt.parameters())[:1])  # non-strict zip: a prefix (FSDP holes)
    assert not updater.is_cached


def test_get_local_tensor_if_dtensor_plain_passthrough():
    t = torch.ones(2)
    assert get_local_tensor_if_dtensor(t) is t
    assert get_local_tensor_if_dtensor(None) is None


def test_error_messages_single_process():
    updater = DTensorFastEmaModelUpdater()
    with pytest.raises(
        TypeError,
        match=r"update_average: target parameter 'weight' is torch.bfloat16, not "
        r"torch.float32: an EMA in lower precision silently loses",
    ):
        updater.update_average(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16))
    with pytest.raises(
        ValueError,
        match=r"update_average: the source has 2 parameters but the target has 4; "
        r"both must hold the same parameters, sharded the same way",
    ):
        updater.update_average(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(
        ValueError,
        match=r"the local shard of source parameter 'weight' has shape \(3, 2\) but "
        r"target parameter 'weight' has \(5, 2\)",
    ):
        updater.copy_to(nn.Linear(2, 3), nn.Linear(2, 5))
    with pytest.raises(ValueError, match=r"EMA beta=1.5 must be in \[0, 1\]"):
        ShardedEMA(nn.Linear(2, 2), beta=1.5)
    ema = ShardedEMA(nn.Linear(2, 3))
    with pytest.raises(
        ValueError,
        match=r"ShardedEMA.update: the model has 4 parameters but the EMA has 2; pass "
        r"the model the EMA was created from",
    ):
        ema.update(nn.Sequential(nn.Linear(2, 3), nn.Linear(2, 3)))
    with pytest.raises(
        ValueError,
        match=r"ShardedEMA.copy_to: the local shard of model parameter 'weight' has "
        r"shape \(4, 2\) but EMA parameter 'weight' has \(3, 2\)",
    ):
        ema.copy_to(nn.Linear(2, 4))
    with pytest.raises(KeyError, match=r"missing keys \['bias'\], unexpected keys \['b'\]"):
        ema.load_state_dict({"weight": torch.zeros(3, 2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'bias' has local shape \(4,\) but this rank's EMA shard has \(3,\)"):
        ema.load_state_dict({"weight": torch.zeros(3, 2), "bias": torch.zeros(4)})
    with pytest.raises(RuntimeError, match="EMA cache is not taken: call cache"):
        updater.restore([])
    updater.cache([torch.zeros(2)])
    with pytest.raises(RuntimeError, match="EMA cache is already taken. Did you forget to restore it?"):
        updater.cache([torch.zeros(2)])
    with pytest.raises(
        ValueError,
        match=r"restore: cached shard of shape \(2,\) does not fit a parameter whose "
        r"local shard has shape \(3,\)",
    ):
        updater.restore([torch.zeros(3)])
