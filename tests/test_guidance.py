"""Classifier-free guidance: the same model code at cfg 1 and cfg 2, exact against one process; errors on every rank."""

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.errors import DisagreementError, ShapeMismatchError
from wf_mesh.guidance import COND_RANK, UNCOND_RANK, combine_guidance, guided_prediction, split_branches
from wf_mesh.testing import run_distributed

from helpers import raised_everywhere, sample

SCALE = 4.5
BATCH = 3  # samples per branch


def denoiser():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).double()


def branch_batch():
    """``[cond; uncond]`` inputs of one step: the conditional half first."""
    return torch.cat([sample((BATCH, 8), seed=1, dtype=torch.float64), sample((BATCH, 8), seed=2, dtype=torch.float64)])


def sampling_step(mesh=None):
    """The model code, the same at cfg 1 and 2: split the batch, run the model, guide; and the input grads."""
    model, batch = denoiser(), branch_batch().requires_grad_()
    guided = guided_prediction(model(split_branches(batch, mesh=mesh)), SCALE, mesh=mesh)
    guided.square().sum().backward()
    return guided.detach(), batch.grad


def branch_by_branch():
    """One process running the model on each branch's B samples, as the cfg ranks do (a matmul over 2B rows
    may round differently from two over B), then guiding the pair; and the input grads."""
    model, batch = denoiser(), branch_batch().requires_grad_()
    guided = guided_prediction((model(batch[:BATCH]), model(batch[BATCH:])), SCALE)
    guided.square().sum().backward()
    return guided.detach(), batch.grad


# ---- one process ----------------------------------------------------------------------------------------
def test_combine_guidance_is_the_formula():
    cond, uncond = sample((2, 4), seed=3), sample((2, 4), seed=4)
    assert torch.equal(combine_guidance(cond, uncond, SCALE), uncond + SCALE * (cond - uncond))
    assert torch.allclose(combine_guidance(cond, uncond, 1.0), cond)  # 1: the conditional prediction
    assert torch.equal(combine_guidance(cond, uncond, 0), uncond)  # 0: the unconditional one


def test_cfg_1_takes_a_branch_batch_or_a_pair():
    prediction = denoiser()(branch_batch())
    cond, uncond = prediction[:BATCH], prediction[BATCH:]
    expected = uncond + SCALE * (cond - uncond)
    assert torch.equal(guided_prediction(prediction, SCALE), expected)
    assert torch.equal(guided_prediction((cond, uncond), SCALE), expected)
    assert split_branches(branch_batch()).shape == (2 * BATCH, 8)  # no mesh: both branches here


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: guided_prediction(torch.ones(3, 2), 2.0), ValueError, r"even dim 0.*got shape \(3, 2\)"),
        (lambda: guided_prediction((torch.ones(2), torch.ones(3)), 2.0), ShapeMismatchError, r"cond is .* \(2,\)"),
        (lambda: guided_prediction([torch.ones(2)] * 3, 2.0), TypeError, "a tensor of both branches or a"),
        (lambda: guided_prediction(torch.ones(2), "2"), TypeError, "scale must be a finite real number, got str"),
        (lambda: guided_prediction(torch.ones(2), float("nan")), TypeError, "finite real number"),
        (lambda: split_branches(torch.ones(3)), ValueError, r"even dim 0 \(\[cond; uncond\]\), got shape \(3,\)"),
    ],
)
def test_cfg_1_misuse(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---- the cfg axis -----------------------------------------------------------------------------------------
def cfg_parallel_step(dims_kw):
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cfg=2, **dims_kw))
    guided, grad = sampling_step(mesh)
    local = split_branches(branch_batch(), mesh=mesh)
    return {"cfg": mesh.rank("cfg"), "guided": guided, "grad": grad, "local": local}


@pytest.mark.parametrize(
    "world, dims_kw",
    [(2, {}), (4, {"tp": 2}), (4, {"dp": 2}), (4, {"cp": 2, "order": "cp-tp-pp-dp"})],
    ids=["cfg2", "tp2-cfg2", "cfg2-dp2", "cp2-cfg2-order"],
)
def test_cfg_2_equals_one_process(world, dims_kw):
    expected, expected_grad = branch_by_branch()
    assert torch.allclose(sampling_step()[0], expected, atol=1e-12)  # one process, both branches in one batch
    plan = wf_mesh.ParallelDims(cfg=2, **dims_kw).resolve(world)
    batch = branch_batch()
    for rank, out in enumerate(run_distributed(world, cfg_parallel_step, dims_kw)):
        assert out["cfg"] == plan.coords(rank)["cfg"]
        half = batch[:BATCH] if out["cfg"] == COND_RANK else batch[BATCH:]
        assert torch.equal(out["local"], half), rank  # this rank's branch
        assert torch.equal(out["guided"], expected), rank  # bitwise: the same formula on the same values
        # each rank's gradient is its own branch's part of the one-process gradient
        part = expected_grad[:BATCH] if out["cfg"] == COND_RANK else expected_grad[BATCH:]
        assert torch.allclose(out["grad"][out["cfg"] * BATCH : (out["cfg"] + 1) * BATCH], part, atol=1e-12), rank
    assert (COND_RANK, UNCOND_RANK) == (0, 1)


def guidance_misuse(case):
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(cfg=2))
    branch = mesh.rank("cfg")
    if case == "shape":
        return guided_prediction(torch.ones(2, 3 + branch), SCALE, mesh=mesh)
    if case == "dtype":
        return guided_prediction(torch.ones(2, dtype=torch.float32 if branch else torch.float64), SCALE, mesh=mesh)
    if case == "scale":
        return guided_prediction(torch.ones(2), SCALE + dist.get_rank() % 2, mesh=mesh)
    if case == "pair":  # a cfg=1 pair on one rank only: its peer must not hang
        prediction = (torch.ones(2), torch.ones(2)) if branch == UNCOND_RANK else torch.ones(2)
        return guided_prediction(prediction, SCALE, mesh=mesh)


GUIDANCE_MISUSE = {
    "shape": (
        ShapeMismatchError,
        r"^guided_prediction: ranks disagree on \(prediction shape, prediction dtype\) \(rank 0: \(\(2, 3\), "
        r"torch.float32\); rank 1: \(\(2, 4\), torch.float32\)\); both branches must predict alike$",
    ),
    "dtype": (ShapeMismatchError, r"rank 0: \(\(2,\), torch.float64\); rank 1: \(\(2,\), torch.float32\)"),
    "scale": (DisagreementError, r"^guided_prediction: ranks disagree on scale \(rank 0: 4.5; rank 1: 5.5\)$"),
    "pair": (TypeError, r"^guided_prediction: rank 1: with cfg=2 each rank passes its own branch's prediction"),
}


@pytest.mark.parametrize("case", list(GUIDANCE_MISUSE))
def test_guidance_misuse_raises_on_every_rank(case):
    error, match = GUIDANCE_MISUSE[case]
    raised_everywhere(run_distributed(2, guidance_misuse, case, return_exceptions=True), error, match)


def cfg_1_on_a_mesh():
    mesh = wf_mesh.init_parallel(wf_mesh.ParallelDims(tp=2))  # cfg 1: each rank holds both branches
    return sampling_step(mesh)[0], sampling_step()[0]  # the mesh given, or found as the current one


def test_a_mesh_with_cfg_1_guides_locally():
    alone = sampling_step()[0]  # the pytest process has no mesh
    for given, current in run_distributed(2, cfg_1_on_a_mesh):
        assert torch.equal(given, alone) and torch.equal(current, alone)
