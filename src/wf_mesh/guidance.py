"""Classifier-free guidance, one sampling step's two branches on one process or on the two ranks of the cfg axis.

A diffusion sampler with classifier-free guidance runs its denoiser twice per step, on the conditional input
(the prompt) and on the unconditional one (an empty or negative prompt), and combines the two predictions::

    guided = uncond + scale * (cond - uncond)            # combine_guidance(cond, uncond, scale)

With ``ParallelDims(cfg=2)`` the two branches run at once on different ranks (xDiT's CFG parallel,
SGLang-diffusion's ``--cfg-parallel-size 2``): the rank with cfg coordinate :data:`COND_RANK` (0) computes the
conditional prediction, the rank with coordinate :data:`UNCOND_RANK` (1) the unconditional one, and
:func:`guided_prediction` exchanges them over the cfg group (one all-gather) and returns the guided prediction
on BOTH ranks, so the next step starts from the same latents everywhere.

The same model code runs at cfg 1 and cfg 2, as in xDiT: build the batch of both branches, conditional half
first, and let :func:`split_branches` keep this rank's part of it::

    batch = torch.cat([cond_inputs, uncond_inputs])      # 2B samples: [cond; uncond]
    local = split_branches(batch, mesh=mesh)             # cfg=2: this rank's B; cfg=1: all 2B
    guided = guided_prediction(model(local), scale, mesh=mesh)   # B samples, on every rank

At cfg 1 (no mesh, or a mesh whose cfg degree is 1) :func:`guided_prediction` takes the prediction of the
whole batch (its first half conditional) or a ``(cond, uncond)`` pair, and combines locally. At cfg 2 the
ranks first agree on the prediction's shape and dtype and on the scale (:mod:`wf_mesh.agreement`): a mismatch
raises on every rank before data moves. The exchange is a DTensor ``full_tensor``, so gradients flow back to
each rank's own branch (as in one process, when every rank backpropagates the same loss).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from wf_mesh import agreement
from wf_mesh.context_parallel import sequence_dtensor
from wf_mesh.errors import DisagreementError, ShapeMismatchError
from wf_mesh.mesh import ParallelMesh, parallel_mesh_or_none

__all__ = ["COND_RANK", "UNCOND_RANK", "combine_guidance", "guided_prediction", "split_branches"]

COND_RANK = 0
"""The cfg coordinate of the rank that runs the conditional branch (the first half of a branch batch)."""

UNCOND_RANK = 1
"""The cfg coordinate of the rank that runs the unconditional branch (the second half)."""

BRANCHES = 2
"""Classifier-free guidance has two branches: the cfg degree at most, and the parts of a branch batch."""

Prediction = torch.Tensor | Sequence[torch.Tensor]


def combine_guidance(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The guided prediction ``uncond + scale * (cond - uncond)`` (pure; autograd flows to both).

    Args:
        cond: the conditional branch's prediction.
        uncond: the unconditional branch's prediction (same shape).
        scale: the guidance scale (1: the conditional prediction; 0: the unconditional one).

    Returns:
        The guided prediction.
    """
    return uncond + scale * (cond - uncond)


def _cfg_mesh(mesh: ParallelMesh | None) -> ParallelMesh | None:
    """The mesh whose cfg axis splits the branches, or None when they run in this process (cfg 1)."""
    if mesh is None:
        mesh = parallel_mesh_or_none()
    if mesh is not None and not isinstance(mesh, ParallelMesh):
        raise TypeError(f"mesh must be a ParallelMesh or None, got {type(mesh).__name__}")
    return mesh if mesh is not None and mesh.dims.cfg_enabled else None


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale)):
        raise TypeError(f"scale must be a finite real number, got {type(scale).__name__} {scale!r}")
    return float(scale)


def split_branches(batch: torch.Tensor, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """This rank's part of a batch of both branches (``[cond; uncond]`` along dim 0); no communication.

    Args:
        batch: the inputs of both branches, the conditional half first.
        mesh: the mesh (default: the current one, if any). With cfg 2 this rank keeps its branch's half
            (:data:`COND_RANK` the first); otherwise it keeps the whole batch.

    Returns:
        A view of ``batch``.

    Raises:
        TypeError: ``batch`` is not a tensor.
        ValueError: ``batch`` has no even dim 0.
    """
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"split_branches: batch must be a torch.Tensor, got {type(batch).__name__}")
    if batch.ndim == 0 or batch.shape[0] % BRANCHES:
        raise ValueError(
            f"split_branches: a batch of both branches has an even dim 0 ([cond; uncond]), got shape "
            f"{tuple(batch.shape)}"
        )
    cfg = _cfg_mesh(mesh)
    if cfg is None:
        return batch
    return batch.chunk(BRANCHES)[cfg.rank("cfg")]


@dataclasses.dataclass(frozen=True)
class _GuidanceFacts(agreement.Facts):
    shape: tuple[int, ...] = agreement.fact(label="prediction shape")
    dtype: torch.dtype = agreement.fact(label="prediction dtype")
    scale: float = agreement.fact(label="scale")


def _facts(prediction: object, scale: object) -> _GuidanceFacts:
    """This rank's checks of a cfg-parallel guided_prediction call, as its record."""
    if not isinstance(prediction, torch.Tensor):
        raise TypeError(
            f"with cfg=2 each rank passes its own branch's prediction as one tensor, got "
            f"{type(prediction).__name__} (a (cond, uncond) pair is for cfg=1)"
        )
    return _GuidanceFacts(shape=tuple(prediction.shape), dtype=prediction.dtype, scale=_check_scale(scale))


def guided_prediction(prediction: Prediction, scale: float, *, mesh: ParallelMesh | None = None) -> torch.Tensor:
    """The guided prediction of one sampling step, on every rank (module docstring).

    Args:
        prediction: with cfg 2, this rank's branch's prediction (conditional on cfg coordinate
            :data:`COND_RANK`, unconditional on :data:`UNCOND_RANK`); with cfg 1, the prediction of a batch of
            both branches (dim 0: the conditional half first) or a ``(cond, uncond)`` pair.
        scale: the guidance scale.
        mesh: the mesh (default: the current one, if any); its cfg degree decides where the branches are.

    Returns:
        ``uncond + scale * (cond - uncond)``: with cfg 2 the same tensor on both ranks of a cfg group.

    Raises:
        ShapeMismatchError: the branches' predictions differ in shape or dtype (with cfg 2: on every rank of the
            cfg group, before data moves).
        DisagreementError: the ranks of a cfg group pass different scales.
        TypeError, ValueError: a bad argument (with cfg 2: on every rank of the cfg group).
    """
    cfg = _cfg_mesh(mesh)
    if cfg is None:
        cond, uncond = _local_branches(prediction)
        return combine_guidance(cond, uncond, _check_scale(scale))
    group: DeviceMesh = cfg["cfg"]
    agreed = agreement.agree(group.get_group(), lambda: _facts(prediction, scale), what="guided_prediction")
    agreed.require_same("shape", "dtype", error=ShapeMismatchError, hint="; both branches must predict alike")
    agreed.require_same("scale", error=DisagreementError)
    assert isinstance(prediction, torch.Tensor)  # _facts checked it
    shape = (BRANCHES, *prediction.shape)
    both = sequence_dtensor(prediction.unsqueeze(0), 0, shape, mesh=group).full_tensor()
    return combine_guidance(both[COND_RANK], both[UNCOND_RANK], float(scale))


def _local_branches(prediction: Prediction) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cond, uncond)`` of a cfg-1 prediction: a pair, or the two halves of a branch batch."""
    if isinstance(prediction, torch.Tensor):
        if prediction.ndim == 0 or prediction.shape[0] % BRANCHES:
            raise ValueError(
                "guided_prediction: with cfg=1 the prediction is of a batch of both branches (an even dim 0, "
                f"[cond; uncond]) or a (cond, uncond) pair; got shape {tuple(prediction.shape)}"
            )
        cond, uncond = prediction.chunk(BRANCHES)
        return cond, uncond
    if not isinstance(prediction, Sequence) or len(prediction) != BRANCHES:
        raise TypeError(
            "guided_prediction: with cfg=1 pass a tensor of both branches or a (cond, uncond) pair, got "
            f"{type(prediction).__name__}"
        )
    cond, uncond = prediction
    if not (isinstance(cond, torch.Tensor) and isinstance(uncond, torch.Tensor)):
        raise TypeError(
            f"guided_prediction: the pair must hold two tensors, got ({type(cond).__name__}, {type(uncond).__name__})"
        )
    if cond.shape != uncond.shape or cond.dtype != uncond.dtype:
        raise ShapeMismatchError(
            f"guided_prediction: cond is {cond.dtype} {tuple(cond.shape)} but uncond is {uncond.dtype} "
            f"{tuple(uncond.shape)}; both branches must predict alike"
        )
    return cond, uncond
