"""The legacy two-model EMA of ``worldfoundry`` / Cosmos, on the native shard-local machinery of
:mod:`wf_mesh.ema`: ``DTensorFastEmaModelUpdater`` and ``get_local_tensor_if_dtensor``."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from wf_mesh import _compat
from wf_mesh.ema import ForeachPlan, LocalShards, check_beta, check_same_layout, local_shard

__all__ = ["DTensorFastEmaModelUpdater", "get_local_tensor_if_dtensor"]

SAME_SHARDING = "both must hold the same parameters, sharded the same way (same fully_shard calls, same mesh)"


def get_local_tensor_if_dtensor(tensor):
    """A DTensor's local shard (waiting on an async collective result); anything else unchanged.

    Returns:
        ``DTensor.to_local()``'s tensor (its gradient placements are the DTensor's own), else ``tensor``.
    """
    if isinstance(tensor, DTensor):
        return _compat.wait_if_async(tensor.to_local())
    return tensor


class DTensorFastEmaModelUpdater:
    """Legacy two-model EMA (worldfoundry / Cosmos): foreach ops on local DTensor shards, no communication.

    ``update_average(src_model, tgt_model, beta)`` needs a float32 target (the source may be bf16);
    ``copy_to`` copies local shards; ``cache`` / ``restore`` snapshot and write back a parameter list (e.g.
    around ``copy_to(ema_model, model)`` for an evaluation). Both models must be sharded the same way.
    New code: :class:`ShardedEMA` keeps no second model.
    """

    _MAX_PAIRS = 4

    def __init__(self) -> None:
        self.is_cached = False
        self.collected_params: list[torch.Tensor] = []
        # (id(src), id(tgt)) -> (src shards, tgt shards, plan, first non-float32 target or None), revalidated per
        # call; models are held weakly (an entry goes when either model does)
        self._pairs: dict[tuple[int, int], tuple[LocalShards, LocalShards, ForeachPlan, str | None]] = {}

    def _plan(self, op: str, src_model: nn.Module, tgt_model: nn.Module) -> tuple:
        key = (id(src_model), id(tgt_model))
        entry = self._pairs.get(key)
        if entry is None or not (entry[0].matches(src_model) and entry[1].matches(tgt_model)):
            src, tgt = LocalShards(src_model), LocalShards(tgt_model)
            check_same_layout(op, src, tgt.names, tgt.locals, ("source", "target"), SAME_SHARDING, by_name=False)
            low = next((f"{n!r} is {t.dtype}" for n, t in zip(tgt.names, tgt.locals) if t.dtype != torch.float32), None)
            entry = (src, tgt, ForeachPlan(tgt.locals, src.locals), low)
            self._pairs.pop(key, None)
            if len(self._pairs) >= self._MAX_PAIRS:
                self._pairs.pop(next(iter(self._pairs)))
            self._pairs[key] = entry
            for model in (src_model, tgt_model):
                weakref.finalize(model, self._pairs.pop, key, None)
        return entry

    @torch.no_grad()
    def copy_to(self, src_model: nn.Module, tgt_model: nn.Module) -> None:
        """Overwrite the target's local shards with the source's (no broadcast)."""
        self._plan("copy_to", src_model, tgt_model)[2].copy_()

    @torch.no_grad()
    def update_average(self, src_model: nn.Module, tgt_model: nn.Module, beta: float = 0.9999) -> None:
        """In place on local float32 shards: ``tgt = beta * tgt + (1 - beta) * src``."""
        _, _, plan, low = self._plan("update_average", src_model, tgt_model)
        if low is not None:
            raise TypeError(
                f"update_average: target parameter {low}, not torch.float32: an EMA in lower precision silently "
                "loses the (1 - beta) term; keep the EMA model in float32 (the source may be bf16), or use ShardedEMA"
            )
        plan.lerp_(1.0 - check_beta(beta))

    @torch.no_grad()
    def cache(self, parameters: Iterable[torch.Tensor], is_cpu: bool = False) -> None:
        """Snapshot the local shards of ``parameters`` (on CPU with ``is_cpu``) before a temporary overwrite.

        Raises:
            RuntimeError: the cache is taken (a second ``cache`` without ``restore``), so a restore cannot
                apply the wrong weights.
        """
        if self.is_cached:
            raise RuntimeError("EMA cache is already taken. Did you forget to restore it?")
        locals_ = [local_shard(p) for p in parameters]
        self.collected_params = [t.to("cpu", copy=True) if is_cpu else t.clone() for t in locals_]
        self.is_cached = True

    @torch.no_grad()
    def restore(self, parameters: Iterable[torch.Tensor]) -> None:
        """Write the cached shards back into ``parameters`` and release the cache.

        Zips non-strictly (a shorter list, e.g. FSDP holes, restores a prefix).

        Raises:
            RuntimeError: nothing is cached.
            ValueError: a cached shard does not fit its parameter.
        """
        if not self.is_cached:
            raise RuntimeError("EMA cache is not taken: call cache(parameters) before restore(parameters)")
        for cached, param in zip(self.collected_params, parameters):
            local = local_shard(param)
            if cached.shape != local.shape:
                raise ValueError(
                    f"restore: cached shard of shape {tuple(cached.shape)} does not fit a parameter whose local "
                    f"shard has shape {tuple(local.shape)}; restore the same parameters that were cached"
                )
            local.copy_(cached)
        self.collected_params = []
        self.is_cached = False
