"""Shard-local EMA of model weights: float32 copies of each parameter's LOCAL shard, no communication.

With FSDP2 every parameter is a DTensor and each rank owns one shard, so the EMA of the whole model is the
EMA of each rank's shard: no gather, no second deep-copied model. Plain (non-DTensor) modules work the same
way (the "shard" is the whole tensor). ::

    fully_shard(block, mesh=pm.fsdp_mesh()) ...       # or mesh=pm.hsdp_mesh(); then init the weights
    ema = ShardedEMA(model, beta=0.9999)               # float32 copies of this rank's shards
    for batch in data:
        loss_fn(model, batch).backward(); optim.step(); optim.zero_grad()
        ema.update(model)                              # one fused lerp per (device, dtype) group
    with ema.swapped_into(model):                      # EMA weights in the model, training weights back on exit
        evaluate(model)
    dcp.save({"ema": ema.state_dict()}, checkpoint_id=path)   # DTensors, saved like the model

The tensor lists are collected once; each call checks, cheaply, that the model still registers the same
parameters and shards (FSDP2 swaps in unsharded parameters between forward and backward; ``load_state_dict(
assign=True)`` or ``model.to()`` replace them) and re-collects, with full checks, only when it does not.

Legacy: :class:`DTensorFastEmaModelUpdater` (two models, ``update_average(src, tgt, beta)``) and
:func:`get_local_tensor_if_dtensor` are a thin layer over the same code.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from wf_mesh import _compat

__all__ = ["DTensorFastEmaModelUpdater", "ShardedEMA", "get_local_tensor_if_dtensor"]

SAME_SHARDING = "both must hold the same parameters, sharded the same way (same fully_shard calls, same mesh)"
SAME_AS_EMA = "pass the model the EMA was created from (same parameters, sharded the same way)"


def get_local_tensor_if_dtensor(tensor):
    """A DTensor's local shard (waiting on an async collective result); anything else unchanged.

    The local tensor is ``DTensor.to_local()``'s: its gradient placements are the DTensor's own placements.
    """
    if isinstance(tensor, DTensor):
        return _compat.wait_if_async(tensor.to_local())
    return tensor


def _require_resharded(model: nn.Module, role: str) -> None:
    """RuntimeError if FSDP2 holds any of ``model``'s parameters unsharded (writes to shards would be lost)."""
    unsharded = _compat.fsdp_unsharded_modules(model)
    if unsharded:
        raise RuntimeError(
            f"{role} has FSDP2 modules whose parameters are not resharded: {unsharded}. FSDP2 keeps "
            "parameters unsharded after forward until backward (always with reshard_after_forward=False, "
            "the root's default); call .reshard() on those modules (model.reshard() for '<root>'; it is not "
            "recursive), or run it after backward and optimizer.step()"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return _compat.dtensor_local(tensor) if isinstance(tensor, DTensor) else tensor


class _Shards:
    """A model's parameters (``named_parameters()`` order) and their local shards, collected once.

    :meth:`matches` is the per-call check: same model, same registered parameter objects, same DTensor shard
    objects. Plain parameters are held as the parameter objects themselves, so an in-place ``param.data``
    swap is followed (a dtype or device change after capture is not: build a new EMA after ``module.to``).
    """

    def __init__(self, model: nn.Module, role: str) -> None:
        _require_resharded(model, role)
        self.model = model
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self._dicts: list[dict] = []
        self._attrs: list[str] = []
        seen: set[int] = set()
        for prefix, module in model.named_modules():
            for attr, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                self.names.append(f"{prefix}.{attr}" if prefix else attr)
                self.params.append(param)
                self._dicts.append(module._parameters)
                self._attrs.append(attr)
        self.locals = [_local(p) for p in self.params]
        self._dtensors = [p for p in self.params if isinstance(p, DTensor)]
        self._dlocals = [_compat.dtensor_local(p) for p in self._dtensors]

    def matches(self, model: nn.Module) -> bool:
        return (
            model is self.model
            and all(map(operator.is_, map(dict.get, self._dicts, self._attrs), self.params))
            and all(map(operator.is_, map(_compat.dtensor_local, self._dtensors), self._dlocals))
        )


def _check_pair(op: str, src: _Shards, tgt_names: list[str], tgt: list[torch.Tensor], labels, hint: str) -> None:
    """Same count and local shapes, else a ValueError naming the first difference; ``labels`` = (src, tgt)."""
    if len(src.locals) != len(tgt):
        raise ValueError(
            f"{op}: the {labels[0]} has {len(src.locals)} parameters but the {labels[1]} has {len(tgt)}; {hint}"
        )
    for s_name, s, t_name, t in zip(src.names, src.locals, tgt_names, tgt):
        if s.shape != t.shape:
            raise ValueError(
                f"{op}: the local shard of {labels[0]} parameter {s_name!r} has shape {tuple(s.shape)} but "
                f"{labels[1]} parameter {t_name!r} has {tuple(t.shape)}; {hint}"
            )


class _Plan:
    """``dst``/``src`` shard pairs grouped by (device, dst dtype, src dtype) for foreach kernels, built once."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for d, s in zip(dst, src):
            if d.numel():
                ds, ss = groups.setdefault((d.device, d.dtype, s.dtype), ([], []))
                ds.append(d)
                ss.append(s)
        self.groups = [(d_dtype == s_dtype, ds, ss) for (_, d_dtype, s_dtype), (ds, ss) in groups.items()]

    def lerp_(self, weight: float) -> None:
        """``dst += weight * (src - dst)``, i.e. ``dst = (1 - weight) * dst + weight * src``."""
        for same_dtype, ds, ss in self.groups:
            if same_dtype:
                torch._foreach_lerp_(ds, ss, weight)
            else:
                torch._foreach_mul_(ds, 1.0 - weight)
                torch._foreach_add_(ds, ss, alpha=weight)

    def copy_(self) -> None:
        for _, ds, ss in self.groups:
            torch._foreach_copy_(ds, ss)


def _check_beta(beta: float) -> float:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"EMA beta={beta!r} must be in [0, 1] (typically 0.999 to 0.9999)")
    return float(beta)


def _reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class ShardedEMA:
    """Float32 EMA of ``model``'s local parameter shards: ``ema = beta * ema + (1 - beta) * param``.

    Create it after ``fully_shard`` and weight initialization (it starts as a copy of the weights). The
    model may train in bf16; the EMA is always float32 (``1 - beta`` underflows in bf16).

    Args:
        model: an FSDP2 model (resharded, i.e. not between forward and backward) or any ``nn.Module``.
        beta: decay per :meth:`update`; override per call with ``update(model, beta=...)``.
    """

    def __init__(self, model: nn.Module, *, beta: float = 0.9999) -> None:
        self.beta = _check_beta(beta)
        source = _Shards(model, "ShardedEMA: the model")
        self.names: list[str] = source.names
        with torch.no_grad():
            self._ema = [
                torch.empty_like(t, dtype=torch.float32, memory_format=torch.contiguous_format).copy_(t)
                for t in source.locals
            ]
        self._bind(source)

    def _bind(self, source: _Shards) -> None:
        self._source = source
        self._specs = [  # for state_dict: the parameters' mesh, placements and global shape
            (p.device_mesh, p.placements, p.shape, p.stride()) if isinstance(p, DTensor) else None
            for p in source.params
        ]
        self._pull = _Plan(self._ema, source.locals)  # EMA <- model
        self._push = _Plan(source.locals, self._ema)  # model <- EMA

    def _sync(self, model: nn.Module, op: str) -> list[torch.Tensor]:
        """The model's local shards, re-collected (and checked against the EMA) only if they changed."""
        if not self._source.matches(model):
            source = _Shards(model, f"ShardedEMA.{op}: the model")
            _check_pair(f"ShardedEMA.{op}", source, self.names, self._ema, ("model", "EMA"), SAME_AS_EMA)
            self._bind(source)
        return self._source.locals

    @torch.no_grad()
    def update(self, model: nn.Module, *, beta: float | None = None) -> None:
        """One EMA step from ``model``'s current weights (call it after ``optimizer.step()``)."""
        self._sync(model, "update")
        self._pull.lerp_(1.0 - (self.beta if beta is None else _check_beta(beta)))

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite ``model``'s local shards with the EMA (cast to the model's dtype). Permanent."""
        self._sync(model, "copy_to")
        self._push.copy_()

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Context manager: the EMA weights in ``model`` inside, the training weights restored exactly on exit.

        On exit, FSDP2 modules are resharded first, so that parameters a forward inside the block left
        unsharded (with EMA values) are gathered again from the restored shards by the next forward.
        """
        with torch.no_grad():
            shards = self._sync(model, "swapped_into")
            backup = [torch.empty_like(t) for t in shards]
            torch._foreach_copy_(backup, shards)
            self._push.copy_()
        try:
            yield model
        finally:
            with torch.no_grad():
                _reshard(model)
                torch._foreach_copy_(shards, backup)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{parameter name: EMA}``; DTensor parameters give DTensors with the parameter's mesh, placements
        and global shape (sharing the EMA's memory), so ``torch.distributed.checkpoint`` saves and loads them
        like the model, at any world size."""
        out = {}
        for name, ema, spec in zip(self.names, self._ema, self._specs):
            if spec is None:
                out[name] = ema
            else:
                mesh, placements, shape, stride = spec
                out[name] = DTensor.from_local(ema, mesh, placements, shape=shape, stride=stride)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy a :meth:`state_dict` (e.g. filled by ``dcp.load``) into the EMA; keys must match exactly."""
        missing = [n for n in self.names if n not in state_dict]
        unexpected = sorted(set(state_dict) - set(self.names))
        if missing or unexpected:
            raise KeyError(f"ShardedEMA.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, ema in zip(self.names, self._ema):
            value = get_local_tensor_if_dtensor(state_dict[name])
            if value.shape != ema.shape:
                raise ValueError(
                    f"ShardedEMA.load_state_dict: {name!r} has local shape {tuple(value.shape)} but this rank's "
                    f"EMA shard has {tuple(ema.shape)}; load DTensors with the model's sharding (dcp.load into "
                    "ema.state_dict())"
                )
            if value.data_ptr() != ema.data_ptr():
                ema.copy_(value)

    def __len__(self) -> int:
        return len(self._ema)

    def __repr__(self) -> str:
        numel = sum(t.numel() for t in self._ema)
        return f"ShardedEMA(beta={self.beta}, parameters={len(self._ema)}, local_elements={numel})"


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
        # (src, tgt) -> (src shards, tgt shards, plan, first non-float32 target or None), revalidated per call
        self._pairs: dict[tuple[int, int], tuple[_Shards, _Shards, _Plan, str | None]] = {}

    def _plan(self, op: str, src_model: nn.Module, tgt_model: nn.Module) -> tuple:
        key = (id(src_model), id(tgt_model))
        entry = self._pairs.get(key)
        if entry is None or not (entry[0].matches(src_model) and entry[1].matches(tgt_model)):
            src = _Shards(src_model, f"{op}: the source model")
            tgt = _Shards(tgt_model, f"{op}: the target model")
            _check_pair(op, src, tgt.names, tgt.locals, ("source", "target"), SAME_SHARDING)
            low = next((f"{n!r} is {t.dtype}" for n, t in zip(tgt.names, tgt.locals) if t.dtype != torch.float32),
                       None)  # fmt: skip
            entry = (src, tgt, _Plan(tgt.locals, src.locals), low)
            self._pairs.pop(key, None)
            if len(self._pairs) >= self._MAX_PAIRS:
                self._pairs.pop(next(iter(self._pairs)))
            self._pairs[key] = entry
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
        plan.lerp_(1.0 - _check_beta(beta))

    @torch.no_grad()
    def cache(self, parameters: Iterable[torch.Tensor], is_cpu: bool = False) -> None:
        """Snapshot the local shards of ``parameters`` (on CPU with ``is_cpu``) before a temporary overwrite.

        A second ``cache`` without ``restore`` is refused, so a restore cannot apply the wrong weights.
        """
        if self.is_cached:
            raise RuntimeError("EMA cache is already taken. Did you forget to restore it?")
        locals_ = [_local(p) for p in parameters]
        self.collected_params = [t.to("cpu", copy=True) if is_cpu else t.clone() for t in locals_]
        self.is_cached = True

    @torch.no_grad()
    def restore(self, parameters: Iterable[torch.Tensor]) -> None:
        """Write the cached shards back into ``parameters`` and release the cache.

        Zips non-strictly (a shorter list, e.g. FSDP holes, restores a prefix).
        """
        if not self.is_cached:
            raise RuntimeError("EMA cache is not taken: call cache(parameters) before restore(parameters)")
        for cached, param in zip(self.collected_params, parameters):
            local = _local(param)
            if cached.shape != local.shape:
                raise ValueError(
                    f"restore: cached shard of shape {tuple(cached.shape)} does not fit a parameter whose local "
                    f"shard has shape {tuple(local.shape)}; restore the same parameters that were cached"
                )
            local.copy_(cached)
        self.collected_params = []
        self.is_cached = False
