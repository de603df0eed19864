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
parameters and shards, and re-collects (matching parameters by name, shapes and shardings checked) only when
it does not: FSDP2 swaps in unsharded parameters after a forward (wf_mesh reshards them first: the EMA
reads and writes shards), ``load_state_dict(assign=True)`` or ``model.to()`` replace them, ``model.half()``
changes their dtype. The EMA holds the model by weak reference only.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from wf_mesh import _compat

__all__ = ["ShardedEMA"]

SAME_AS_EMA = "pass the model the EMA was created from (same parameters, sharded the same way)"


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard object of a DTensor (stable identity while the shard is); a plain tensor itself."""
    return _compat.dtensor_local(tensor) if isinstance(tensor, DTensor) else tensor


class LocalShards:
    """A model's parameters (``named_parameters()`` order) and their local shards, collected once.

    :meth:`matches` is the per-call check: same model, same registered parameter objects, same DTensor shard
    objects. Plain parameters are held as the parameter objects themselves, so an in-place ``param.data``
    swap is followed. The model itself is held by weak reference.
    """

    def __init__(self, model: nn.Module) -> None:
        _compat.reshard_fsdp_modules(model)  # shards are what the EMA reads and writes
        self._model = weakref.ref(model)
        self.names: list[str] = []
        self.params: list[torch.Tensor] = []
        self._dicts: list[dict] = []
        self._attrs: list[str] = []
        seen: set[int] = set()
        for prefix, module in model.named_modules():
            registry = _compat.parameter_registry(module)
            for attr, param in registry.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                self.names.append(f"{prefix}.{attr}" if prefix else attr)
                self.params.append(param)
                self._dicts.append(registry)
                self._attrs.append(attr)
        self.locals = [local_shard(p) for p in self.params]
        self._dtensors = [p for p in self.params if isinstance(p, DTensor)]
        self._dlocals = [_compat.dtensor_local(p) for p in self._dtensors]

    def matches(self, model: nn.Module) -> bool:
        return (
            self._model() is model
            and all(map(operator.is_, map(dict.get, self._dicts, self._attrs), self.params))
            and all(map(operator.is_, map(_compat.dtensor_local, self._dtensors), self._dlocals))
        )


def check_same_layout(
    op: str,
    a: LocalShards,
    b_names: list[str],
    b: list[torch.Tensor],
    labels: tuple[str, str],
    hint: str,
    *,
    by_name: bool,
) -> None:
    """Same count, names (``by_name``) and local shapes, else a ValueError naming the first difference."""
    if len(a.locals) != len(b):
        raise ValueError(
            f"{op}: the {labels[0]} has {len(a.locals)} parameters but the {labels[1]} has {len(b)}; {hint}"
        )
    for a_name, x, b_name, y in zip(a.names, a.locals, b_names, b):
        if by_name and a_name != b_name:
            raise ValueError(
                f"{op}: the {labels[0]} has parameter {a_name!r} where the {labels[1]} has {b_name!r}; {hint}"
            )
        if x.shape != y.shape:
            raise ValueError(
                f"{op}: the local shard of {labels[0]} parameter {a_name!r} has shape {tuple(x.shape)} but "
                f"{labels[1]} parameter {b_name!r} has {tuple(y.shape)}; {hint}"
            )


def _spec(t: torch.Tensor) -> tuple:
    return t.device, t.dtype, t.shape


class ForeachPlan:
    """``dst``/``src`` shard pairs grouped by (device, dst dtype, src dtype) for foreach kernels, built once."""

    def __init__(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for d, s in zip(dst, src):
            if d.numel():
                ds, ss = groups.setdefault((d.device, d.dtype, s.dtype), ([], []))
                ds.append(d)
                ss.append(s)
        self.groups = [(d_dtype == s_dtype, ds, ss) for (_, d_dtype, s_dtype), (ds, ss) in groups.items()]
        self._specs = [_spec(t) for _, ds, ss in self.groups for t in (*ds, *ss)]

    def stale(self) -> bool:
        """Whether a tensor of the plan changed device, dtype or shape in place since it was built.

        Returns:
            True when its groups no longer fit (e.g. ``model.half()`` keeps the parameter objects but swaps
            their data).
        """
        return [_spec(t) for _, ds, ss in self.groups for t in (*ds, *ss)] != self._specs

    def lerp_(self, weight: float) -> None:
        """``dst += weight * (src - dst)``, i.e. ``dst = (1 - weight) * dst + weight * src``."""
        for same_dtype, ds, ss in self.groups:
            if same_dtype:
                _compat.foreach_lerp_(ds, ss, weight)
            else:
                _compat.foreach_mul_(ds, 1.0 - weight)
                _compat.foreach_add_(ds, ss, alpha=weight)

    def copy_(self) -> None:
        for _, ds, ss in self.groups:
            _compat.foreach_copy_(ds, ss)


def check_beta(beta: float) -> float:
    """``beta`` as a float in [0, 1]; TypeError / ValueError name the value."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"EMA beta must be a float in [0, 1], got {type(beta).__name__} {beta!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"EMA beta={beta!r} must be in [0, 1] (typically 0.999 to 0.9999)")
    return float(beta)


class ShardedEMA:
    """Float32 EMA of ``model``'s local parameter shards: ``ema = beta * ema + (1 - beta) * param``.

    Create it after ``fully_shard`` and weight initialization (it starts as a copy of the weights). The
    model may train in bf16; the EMA is always float32 (``1 - beta`` underflows in bf16). Parameters are
    matched by name on every re-collection.

    Args:
        model: an FSDP2 model or any ``nn.Module`` (held by weak reference).
        beta: decay per :meth:`update`; override per call with ``update(model, beta=...)``.
    """

    def __init__(self, model: nn.Module, *, beta: float = 0.9999) -> None:
        self.beta = check_beta(beta)
        source = LocalShards(model)
        self.names: list[str] = source.names
        with torch.no_grad():
            self._ema = [
                torch.empty_like(t, dtype=torch.float32, memory_format=torch.contiguous_format).copy_(t)
                for t in source.locals
            ]
        self._bind(source)

    def _bind(self, source: LocalShards) -> None:
        self._source = source
        self._specs = [  # for state_dict: the parameters' mesh, placements and global shape
            (p.device_mesh, p.placements, p.shape, p.stride()) if isinstance(p, DTensor) else None
            for p in source.params
        ]
        self._pull = ForeachPlan(self._ema, source.locals)  # EMA <- model
        self._push = ForeachPlan(source.locals, self._ema)  # model <- EMA

    def _sync(self, model: nn.Module, op: str, *, force: bool = False) -> list[torch.Tensor]:
        """The model's local shards, re-collected (and checked against the EMA) when they changed."""
        if force or not self._source.matches(model):
            if not isinstance(model, nn.Module):
                raise TypeError(f"ShardedEMA.{op} takes the nn.Module, got {type(model).__name__}")
            source = LocalShards(model)
            check_same_layout(
                f"ShardedEMA.{op}", source, self.names, self._ema, ("model", "EMA"), SAME_AS_EMA, by_name=True
            )
            self._bind(source)
        return self._source.locals

    def _run(self, model: nn.Module, op: str, apply: Callable[[], None]) -> None:
        """``apply()`` the plans to ``model``'s shards; plan again once if they went stale under it.

        The per-call check (:meth:`LocalShards.matches`) sees replaced parameters and shards, not a parameter
        whose data changed dtype or device in place (``model.half()``, ``model.to(...)``); checking every
        tensor's dtype per call would cost more than the update, so such a change shows as the foreach kernel
        failing. Only that failure is retried, after the plans are rebuilt from the model.

        Raises:
            OutOfMemoryError: as raised (never retried).
            RuntimeError: a failure while the plans are not stale, or the retry's.
        """
        self._sync(model, op)
        try:
            apply()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            if not (self._pull.stale() or self._push.stale()):
                raise
            self._sync(model, op, force=True)
            apply()

    @torch.no_grad()
    def update(self, model: nn.Module, *, beta: float | None = None) -> None:
        """One EMA step from ``model``'s current weights (call it after ``optimizer.step()``)."""
        weight = 1.0 - (self.beta if beta is None else check_beta(beta))
        self._run(model, "update", lambda: self._pull.lerp_(weight))

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite ``model``'s local shards with the EMA (cast to the model's dtype). Permanent."""
        self._run(model, "copy_to", lambda: self._push.copy_())

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Context manager: the EMA weights in ``model`` inside, the training weights restored exactly on exit.

        Works whatever state a forward left FSDP2 modules in: unsharded parameters are resharded first (on
        entry and on exit), so the next forward gathers the right shards.

        Yields:
            ``model``, holding the EMA weights.
        """
        with torch.no_grad():
            shards = self._sync(model, "swapped_into")
            backup = [torch.empty_like(t) for t in shards]
            _compat.foreach_copy_(backup, shards)
            self._push.copy_()
        try:
            yield model
        finally:
            with torch.no_grad():
                _compat.reshard_fsdp_modules(model)
                _compat.foreach_copy_(shards, backup)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA weights by parameter name, for ``torch.distributed.checkpoint``.

        Returns:
            ``{parameter name: EMA}``; DTensor parameters give DTensors with the parameter's mesh, placements
            and global shape (sharing the EMA's memory), so DCP saves and loads them like the model, at any
            world size.
        """
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
            value = state_dict[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"ShardedEMA.load_state_dict: {name!r} is a {type(value).__name__}, not a tensor or DTensor"
                )
            value = _compat.wait_if_async(value.to_local()) if isinstance(value, DTensor) else value
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
