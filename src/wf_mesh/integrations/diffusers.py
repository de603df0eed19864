"""Context parallel for the video transformers diffusers ships (tested against diffusers==0.42.1).

:func:`apply_context_parallel` makes a Wan, CogVideoX or HunyuanVideo transformer context-parallel on the cp
axis, in place: after patch embedding each cp rank keeps its ``torch.chunk`` shard of the video tokens (uneven
lengths allowed) and of the rotary tables, every self-attention runs through :func:`wf_mesh.cp_attention`, and
the output is gathered before unpatchify, so every rank returns the full output. Text tokens of the joint models
(CogVideoX, HunyuanVideo) stay replicated on every rank; their keys count once (masked on every cp rank but 0),
so the result equals the unmodified model's. Wan's text enters through cross-attention, which is left as it is.

Gradients: with the same loss computed on every rank from the gathered output, the parameter gradients summed
over cp (as FSDP2 over ``dp_cp`` sums them) equal the unmodified model's.

Only public diffusers API is used: ``set_attn_processor`` / ``attn_processors``, the model's submodules
(``patch_embedding`` / ``patch_embed`` / ``x_embedder``, ``rope``, ``proj_out``) hooked with torch's public
forward hooks, and ``diffusers.models.embeddings.apply_rotary_emb``. Where diffusers has no public piece the
processors re-implement it instead of importing a private one: Wan's q/k/v projection helper
(``_get_qkv_projections``) and its rotary function (local to ``WanAttnProcessor.__call__``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from wf_mesh import agreement
from wf_mesh.attention import cp_attention
from wf_mesh.context_parallel import cp_mesh, gather_sequence, shard_sequence
from wf_mesh.errors import StateError
from wf_mesh.sizing import chunk_sizes

__all__ = [
    "METHODS",
    "SUPPORTED_MODELS",
    "CogVideoXCPAttnProcessor",
    "HunyuanVideoCPAttnProcessor",
    "WanCPAttnProcessor",
    "apply_context_parallel",
    "remove_context_parallel",
]

SUPPORTED_MODELS = ("WanTransformer3DModel", "CogVideoXTransformer3DModel", "HunyuanVideoTransformer3DModel")
"""The diffusers model classes :func:`apply_context_parallel` knows, by class name."""

METHODS = ("ring", "ulysses", "usp", "allgather")

_STATE = "_wf_mesh_context_parallel"


@dataclasses.dataclass
class _CPState:
    """What one context-parallel model keeps: its cp mesh, method, hooks and original processors."""

    model_name: str
    mesh: Any  # the mesh argument cp_attention gets (None: the current ParallelMesh)
    cp: Any  # the 1-D cp DeviceMesh
    method: str
    originals: dict[str, Any]
    installed: dict[str, Any]
    handles: list[Any] = dataclasses.field(default_factory=list)
    longest: int = 0  # the longest video shard of the current forward (the joint models pad to it)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        return cp_attention(q, k, v, layout="bshd", method=self.method, mesh=self.mesh, key_padding_mask=pad)

    def joint(
        self,
        video: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        text: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        text_keep: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of this rank's video shard and the replicated text over every video token and the text once.

        The local sequence is ``[video shard, padding to the longest shard, text]`` (every rank the same length,
        so any method takes it); padding keys, and text keys on every cp rank but 0, are masked.

        Returns:
            ``(video output shard, text output)``, in ``bshd``.
        """
        q_video = video[0]
        batch, local, _, dim = q_video.shape
        fill = self.longest - local
        text_len = text[0].shape[1]
        parts = []
        for x_video, x_text in zip(video, text):
            pieces = (
                [x_video, x_video.new_zeros(batch, fill, x_video.shape[2], dim), x_text] if fill else [x_video, x_text]
            )
            parts.append(torch.cat(pieces, dim=1))
        pad = torch.zeros(batch, self.longest + text_len, dtype=torch.bool, device=q_video.device)
        pad[:, local : self.longest] = True
        if self.cp.get_local_rank() != 0:
            pad[:, self.longest :] = True
        elif text_keep is not None:
            pad[:, self.longest :] = ~text_keep.bool()
        out = self.attention(parts[0], parts[1], parts[2], pad)
        return out[:, :local], out[:, self.longest :]


class _CPProcessor:
    """Base of the CP processors: the model's state (mesh, method, shard lengths) they attend with."""

    def __init__(self, state: _CPState) -> None:
        self.state = state


def _unsupported(what: str, option: str) -> ValueError:
    return ValueError(f"{what}: {option} is not supported with context parallel (it cannot be made exact here)")


class WanCPAttnProcessor(_CPProcessor):
    """Wan self-attention (``attn1``) over the cp-sharded video tokens; cross-attention keeps diffusers' processor."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The self-attention output of this rank's tokens (as ``WanAttnProcessor``)."""
        if encoder_hidden_states is not None or attention_mask is not None:
            raise _unsupported("WanCPAttnProcessor", "cross-attention or an attention mask")
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, x.shape[-1] // attn.heads)) for x in (query, key, value))
        if rotary_emb is not None:
            query, key = _wan_rotary(query, *rotary_emb), _wan_rotary(key, *rotary_emb)
        out = self.state.attention(query, key, value, None).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _wan_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding (as ``WanAttnProcessor`` applies it; diffusers has no public function for it)."""
    x1, x2 = x.unflatten(-1, (x.shape[-1] // 2, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class CogVideoXCPAttnProcessor(_CPProcessor):
    """CogVideoX joint attention: text replicated, video tokens cp-sharded (``CogVideoXAttnProcessor2_0``'s maths)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(video output shard, text output)`` (as ``CogVideoXAttnProcessor2_0``)."""
        apply_rotary_emb = _rotary()

        if attention_mask is not None:
            raise _unsupported("CogVideoXCPAttnProcessor", "an attention mask")
        text_len = encoder_hidden_states.shape[1]
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch = joint.shape[0]
        qkv = [proj(joint).view(batch, joint.shape[1], attn.heads, -1) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        if attn.norm_q is not None:
            qkv[0] = attn.norm_q(qkv[0])
        if attn.norm_k is not None:
            qkv[1] = attn.norm_k(qkv[1])
        text = tuple(x[:, :text_len] for x in qkv)
        video = [x[:, text_len:] for x in qkv]
        if image_rotary_emb is not None and video[0].shape[1]:  # its reshape(..., -1, 2) fails on 0 tokens
            video[0] = apply_rotary_emb(video[0], image_rotary_emb, sequence_dim=1)
            if not attn.is_cross_attention:
                video[1] = apply_rotary_emb(video[1], image_rotary_emb, sequence_dim=1)
        out_video, out_text = self.state.joint((video[0], video[1], video[2]), (text[0], text[1], text[2]), None)
        out = torch.cat([out_text, out_video], dim=1).flatten(2, 3)
        out = attn.to_out[1](attn.to_out[0](out))
        return out[:, text_len:], out[:, :text_len]


class HunyuanVideoCPAttnProcessor(_CPProcessor):
    """HunyuanVideo attention (double- and single-stream blocks): text replicated, video tokens cp-sharded."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(video output shard, text output)`` (as ``HunyuanVideoAttnProcessor2_0``)."""
        apply_rotary_emb = _rotary()

        if encoder_hidden_states is None:
            raise _unsupported("HunyuanVideoCPAttnProcessor", "attention without text tokens")
        text_len = encoder_hidden_states.shape[1]
        single = attn.add_q_proj is None
        source = torch.cat([hidden_states, encoder_hidden_states], dim=1) if single else hidden_states
        qkv = [_heads_of(proj(source), attn.heads) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        if attn.norm_q is not None:
            qkv[0] = attn.norm_q(qkv[0])
        if attn.norm_k is not None:
            qkv[1] = attn.norm_k(qkv[1])
        if single:
            video = [x[:, :-text_len] for x in qkv]
            text = [x[:, -text_len:] for x in qkv]
        else:
            video = qkv
            text = [_heads_of(proj(encoder_hidden_states), attn.heads) for proj in attn_added(attn)]
            if attn.norm_added_q is not None:
                text[0] = attn.norm_added_q(text[0])
            if attn.norm_added_k is not None:
                text[1] = attn.norm_added_k(text[1])
        if image_rotary_emb is not None and video[0].shape[1]:  # its reshape(..., -1, 2) fails on 0 tokens
            video[0] = apply_rotary_emb(video[0], image_rotary_emb, sequence_dim=1)
            video[1] = apply_rotary_emb(video[1], image_rotary_emb, sequence_dim=1)
        keep = None if attention_mask is None else attention_mask.reshape(attention_mask.shape[0], -1)[:, -text_len:]
        out_video, out_text = self.state.joint((video[0], video[1], video[2]), (text[0], text[1], text[2]), keep)
        dtype = qkv[0].dtype
        out_video, out_text = out_video.flatten(2, 3).to(dtype), out_text.flatten(2, 3).to(dtype)
        if getattr(attn, "to_out", None) is not None:
            out_video = attn.to_out[1](attn.to_out[0](out_video))
        if getattr(attn, "to_add_out", None) is not None:
            out_text = attn.to_add_out(out_text)
        return out_video, out_text


def attn_added(attn: Any) -> tuple[nn.Module, nn.Module, nn.Module]:
    return attn.add_q_proj, attn.add_k_proj, attn.add_v_proj


# ---- model tables -------------------------------------------------------------------------------------------
_PROCESSORS: dict[str, type[_CPProcessor]] = {
    "WanTransformer3DModel": WanCPAttnProcessor,
    "CogVideoXTransformer3DModel": CogVideoXCPAttnProcessor,
    "HunyuanVideoTransformer3DModel": HunyuanVideoCPAttnProcessor,
}


def _cp_processor_names(model_name: str, names: list[str]) -> list[str]:
    # the processors that attend over the video tokens (Wan: attn1 only; HunyuanVideo: not the token refiner)
    if model_name == "WanTransformer3DModel":
        return [n for n in names if n.startswith("blocks.") and ".attn1." in n]
    if model_name == "HunyuanVideoTransformer3DModel":
        return [n for n in names if n.startswith(("transformer_blocks.", "single_transformer_blocks."))]
    return [n for n in names if n.startswith("transformer_blocks.")]


def _rotary() -> Any:
    """The ``apply_rotary_emb`` of diffusers (typed Any: its annotation says a 1-tuple where it takes ``(cos, sin)``)."""
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb


def _config_owner(model: nn.Module) -> Any:
    """``model`` as diffusers' ModelMixin (its ``config`` and ``attn_processors`` are not nn.Module's)."""
    return model


def _config(model: nn.Module) -> Any:
    return _config_owner(model).config


def _heads(model: nn.Module) -> int:
    return int(_config(model).num_attention_heads)


def _refusal(model: nn.Module, model_name: str) -> str | None:
    """Why this model's configuration cannot be made exact (None: it can)."""
    if model_name == "HunyuanVideoTransformer3DModel" and _config(model).get("image_condition_type") == "token_replace":
        return "HunyuanVideo's image_condition_type='token_replace' (its first-frame tokens are modulated apart)"
    if getattr(model, "gradient_checkpointing", False):
        return "gradient checkpointing (enable it after apply_context_parallel is not supported either)"
    return None


@dataclasses.dataclass(frozen=True)
class _ApplyFacts(agreement.Facts):
    cp_size: int
    heads: int
    model: str = agreement.fact(choices=SUPPORTED_MODELS)
    method: str = agreement.fact(choices=METHODS)


def apply_context_parallel(model: nn.Module, *, mesh: Any = None, method: str = "ring") -> nn.Module:
    """Make a diffusers video transformer context-parallel on the cp axis, in place; returns ``model``.

    Every cp rank calls it with the same model and then runs the model's ordinary forward on the same full
    inputs: each rank computes its shard of the video tokens and returns the full output (gathered).

    Args:
        model: a ``WanTransformer3DModel``, ``CogVideoXTransformer3DModel`` or ``HunyuanVideoTransformer3DModel``.
        mesh: a ParallelMesh (its ``cp`` axis), a 1-D cp DeviceMesh, or None: the current ParallelMesh.
        method: the :func:`wf_mesh.cp_attention` method: ``"ring"``, ``"ulysses"`` (the heads must divide by the
            cp size), ``"usp"`` or ``"allgather"``.

    Every error below is raised on every cp rank.

    Raises:
        TypeError: a model it does not know (the message names the supported ones).
        ValueError: an unknown method, heads not divisible for ulysses, or an option it cannot make exact
            (HunyuanVideo's ``token_replace``, gradient checkpointing; at forward: Wan's per-token timesteps).
        StateError: the model is already context-parallel.

    Returns:
        ``model``, context-parallel.
    """
    model_name = type(model).__name__
    cp = cp_mesh(mesh)

    def facts() -> _ApplyFacts:
        if model_name not in SUPPORTED_MODELS:
            raise TypeError(f"{model_name} is not a model it knows; supported: {', '.join(SUPPORTED_MODELS)}")
        if method not in METHODS:
            raise ValueError(f"method={method!r}: use one of {', '.join(map(repr, METHODS))}")
        if hasattr(model, _STATE):
            raise StateError(f"{model_name} is already context-parallel (call remove_context_parallel first)")
        reason = _refusal(model, model_name)
        if reason is not None:
            raise ValueError(f"{reason} is not supported with context parallel")
        if method == "ulysses" and _heads(model) % cp.size():
            raise ValueError(
                f"method='ulysses' needs the attention heads ({_heads(model)}) divisible by the cp size ({cp.size()})"
            )
        return _ApplyFacts(cp.size(), _heads(model), model=model_name, method=method)

    agreed = agreement.agree(cp.get_group(), facts, what="apply_context_parallel")
    for name in ("model", "method", "heads"):
        agreed.require_same(name)
    originals = dict(_config_owner(model).attn_processors)
    state = _CPState(model_name, mesh, cp, method, originals, {})
    processor = _PROCESSORS[model_name](state)
    state.installed = dict.fromkeys(_cp_processor_names(model_name, list(originals)), processor)
    model.set_attn_processor({**originals, **state.installed})  # type: ignore[operator]
    _install_hooks(model, state)
    setattr(model, _STATE, state)
    return model


def remove_context_parallel(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_context_parallel`: hooks removed, the original processors back.

    Returns:
        ``model``, as it was.

    Raises:
        StateError: the model is not context-parallel.
    """
    state = getattr(model, _STATE, None)
    if state is None:
        raise StateError(f"{type(model).__name__} is not context-parallel (apply_context_parallel was not called)")
    for handle in state.handles:
        handle.remove()
    model.set_attn_processor(dict(state.originals))  # type: ignore[operator]
    delattr(model, _STATE)
    return model


# ---- hooks --------------------------------------------------------------------------------------------------
def _install_hooks(model: Any, state: _CPState) -> None:
    handles = state.handles
    handles.append(model.register_forward_pre_hook(_check_hook(state), with_kwargs=True))
    name = state.model_name
    if name == "WanTransformer3DModel":
        handles.append(model.patch_embedding.register_forward_hook(_wan_patches(state)))
        handles.append(model.rope.register_forward_hook(_shard_tables(state, dim=1)))
    elif name == "CogVideoXTransformer3DModel":
        handles.append(model.patch_embed.register_forward_hook(_cogvideox_patches(state)))
        handles.append(model.register_forward_pre_hook(_cogvideox_rope(state, model), with_kwargs=True))
    else:
        handles.append(model.x_embedder.register_forward_hook(_shard_tokens(state)))
        handles.append(model.rope.register_forward_hook(_shard_tables(state, dim=0)))
    handles.append(model.proj_out.register_forward_hook(_gather(state)))


def _check_hook(state: _CPState) -> Any:
    def hook(model: Any, args: tuple, kwargs: dict) -> None:
        def facts() -> agreement.Facts:
            current = _config_owner(model).attn_processors
            replaced = [n for n, p in state.installed.items() if current.get(n) is not p]
            if replaced:
                raise StateError(
                    f"{state.model_name}: the context-parallel attention processors were replaced "
                    f"({', '.join(replaced[:3])}{', ...' if len(replaced) > 3 else ''}); call "
                    "remove_context_parallel before set_attn_processor, then apply_context_parallel again"
                )
            if state.model_name == "WanTransformer3DModel":
                timestep = _argument(model, args, kwargs, "timestep")
                if timestep is not None and timestep.ndim == 2:
                    raise _unsupported(state.model_name, "a per-token timestep (Wan 2.2 TI2V)")
            return _NoFacts()

        agreement.agree(state.cp.get_group(), facts, what="diffusers context-parallel forward")

    return hook


@dataclasses.dataclass(frozen=True)
class _NoFacts(agreement.Facts):
    pass


def _argument(model: Any, args: tuple, kwargs: dict, name: str) -> Any:
    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    return bound.arguments.get(name)


def _shard(state: _CPState, x: torch.Tensor, dim: int) -> torch.Tensor:
    return shard_sequence(x, seq_dim=dim, mesh=state.cp)


def _note_length(state: _CPState, length: int) -> None:
    state.longest = chunk_sizes(length, state.cp.size())[0]


def _wan_patches(state: _CPState) -> Any:
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        # (B, C, F, H, W) -> (B, C, S_r, 1, 1): the model's own flatten(2).transpose(1, 2) then gives the shard
        tokens = out.flatten(2)
        _note_length(state, tokens.shape[2])
        return _shard(state, tokens, 2)[..., None, None]

    return hook


def _shard_tokens(state: _CPState) -> Any:
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        _note_length(state, out.shape[1])
        return _shard(state, out, 1)

    return hook


def _shard_tables(state: _CPState, dim: int) -> Any:
    def hook(module: nn.Module, args: tuple, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(_shard(state, t, dim) for t in out)

    return hook


def _cogvideox_patches(state: _CPState) -> Any:
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        text_len = args[0].shape[1]  # patch_embed(text_embeds, image_embeds) -> [text, video]
        _note_length(state, out.shape[1] - text_len)
        return torch.cat([out[:, :text_len], _shard(state, out[:, text_len:], 1)], dim=1)

    return hook


def _cogvideox_rope(state: _CPState, model: Any) -> Any:
    signature = inspect.signature(model.forward)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        bound = signature.bind(*args, **kwargs)
        tables = bound.arguments.get("image_rotary_emb")
        if tables is None:
            return None
        bound.arguments["image_rotary_emb"] = tuple(_shard(state, t, 0) for t in tables)
        return bound.args, bound.kwargs

    return hook


def _gather(state: _CPState) -> Any:
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return gather_sequence(out, seq_dim=1, mesh=state.cp, grad="replicate")

    return hook


def _heads_of(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, S, H * D) -> (B, S, H, D)`` (explicit sizes: a rank's shard may hold 0 tokens)."""
    return x.unflatten(2, (heads, x.shape[-1] // heads))
