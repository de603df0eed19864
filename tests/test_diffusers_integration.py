"""wf_mesh.integrations.diffusers on real gloo clusters: Wan, CogVideoX and HunyuanVideo (tiny random-init
configs, diffusers==0.42.1) made context-parallel at cp 2 and 4 equal the unmodified single-process model.

Every rank runs the model's forward on the same full inputs and computes the same loss from the gathered
output; the parameter gradients, summed over cp (as FSDP2 over ``dp_cp`` sums them), must equal the reference's.
Each world size runs its whole case list in ONE ``run_distributed`` call (a session fixture). Tolerances:
CogVideoX runs in float64 (1e-12); Wan and HunyuanVideo compute their norms / rotary tables in float32 whatever
the parameters' dtype, so they run in float32 (1e-5, abs + rel).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

import wf_mesh
from wf_mesh.errors import StateError
from wf_mesh.testing import run_distributed

from helpers import sample

diffusers = pytest.importorskip("diffusers")  # the `test` extra pins it: CI never skips

from wf_mesh.integrations.diffusers import (  # noqa: E402
    SUPPORTED_MODELS,
    apply_context_parallel,
    remove_context_parallel,
)

TOL = {"float64": 1e-12, "float32": 1e-5}
# (frames, height, width) of the latent: 12 tokens after 1x2x2 patches (even), 9 (uneven: 5+4, 3+3+3+0)
SHAPES = {"even": (2, 4, 6), "uneven": (3, 2, 6)}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    world: int
    method: str
    shape: str

    @property
    def id(self) -> str:
        return f"{self.model}-cp{self.world}-{self.method}-{self.shape}"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.model == "cogvideox" else torch.float32


MODELS = ("wan", "cogvideox", "hunyuan")
METHODS = ("ring", "ulysses", "allgather")
CASES = {world: [Case(m, world, method, s) for m in MODELS for method in METHODS for s in SHAPES] for world in (2, 4)}
# the fast lane's cp 2 cases: every model, method and shape once (model i, method i or i+1); the rest is slow
FAST = {f"{m}-cp2-{METHODS[(i + j) % 3]}-{s}" for i, m in enumerate(MODELS) for j, s in enumerate(SHAPES)}


def build(name: str, dtype: torch.dtype = torch.float32, **overrides):
    """The tiny random-init model (the same parameters on every rank and in the reference)."""
    from diffusers import CogVideoXTransformer3DModel, HunyuanVideoTransformer3DModel, WanTransformer3DModel

    torch.manual_seed(0)
    if name == "wan":
        config = dict(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
        )  # fmt: skip
        model = WanTransformer3DModel(**{**config, **overrides})
    elif name == "cogvideox":
        config = dict(
            num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
            text_embed_dim=16, num_layers=2, sample_width=12, sample_height=8, sample_frames=5, patch_size=2,
            max_text_seq_length=5, use_rotary_positional_embeddings=True,
        )  # fmt: skip
        model = CogVideoXTransformer3DModel(**{**config, **overrides})
    else:
        config = dict(
            in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), guidance_embeds=False,
        )  # fmt: skip
        model = HunyuanVideoTransformer3DModel(**{**config, **overrides})
    return model.to(dtype)


def inputs(name: str, shape: str, dtype: torch.dtype) -> dict:
    frames, height, width = SHAPES[shape]
    if name == "cogvideox":
        tokens = frames * (height // 2) * (width // 2)
        return dict(
            hidden_states=sample((1, frames, 4, height, width), 1, dtype),
            encoder_hidden_states=sample((1, 5, 16), 2, dtype),
            timestep=torch.tensor([500]),
            image_rotary_emb=(sample((tokens, 8), 3, dtype).cos(), sample((tokens, 8), 3, dtype).sin()),
        )
    kwargs = dict(
        hidden_states=sample((1, 4, frames, height, width), 1, dtype),
        encoder_hidden_states=sample((1, 5, 16), 2, dtype),
        timestep=torch.tensor([500]),
    )
    if name == "hunyuan":  # the last text token is padding
        kwargs.update(encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 0]]), pooled_projections=sample((1, 8), 4))
    return kwargs


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out * sample(out.shape, 9, out.dtype)).sum()


def forward_backward(model, kwargs):
    out = model(**kwargs, return_dict=False)[0]
    loss_of(out).backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_case(case: Case, pm):
    model = apply_context_parallel(build(case.model, case.dtype), mesh=pm, method=case.method)
    out, grads = forward_backward(model, inputs(case.model, case.shape, case.dtype))
    for g in grads.values():
        dist.all_reduce(g, group=pm["cp"].get_group())
    return out, grads if dist.get_rank() == 0 else None


def run_world(cases):
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    try:
        return [run_case(case, pm) for case in cases]
    finally:
        pm.destroy()


@pytest.fixture(scope="session")
def world_results():
    cache = {}

    def get(world, slow=True):  # slow=False: the fast lane's cases only (one batch each)
        key = (world, slow)
        if key not in cache:
            cases = [c for c in CASES[world] if slow or c.id in FAST]
            per_rank = run_distributed(world, run_world, cases)
            cache[key] = {c.id: [per_rank[r][i] for r in range(world)] for i, c in enumerate(cases)}
        return cache[key]

    return get


_REFERENCES: dict = {}


def reference(case: Case):
    key = (case.model, case.shape)
    if key not in _REFERENCES:
        _REFERENCES[key] = forward_backward(build(case.model, case.dtype), inputs(case.model, case.shape, case.dtype))
    return _REFERENCES[key]


def check(case: Case, results):
    want_out, want_grads = reference(case)
    tol = TOL[str(case.dtype).removeprefix("torch.")]
    for rank, (out, _) in enumerate(results):
        assert torch.allclose(out, want_out, atol=tol, rtol=tol), f"rank {rank}: {(out - want_out).abs().max()}"
    grads = results[0][1]
    assert grads.keys() == want_grads.keys()
    worst = max((grads[n] - want_grads[n]).abs().max().item() for n in grads)
    assert all(torch.allclose(grads[n], want_grads[n], atol=tol, rtol=tol) for n in grads), worst


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[] if c.id in FAST else [pytest.mark.slow]) for c in CASES[2]]
)
def test_cp2_equals_the_unmodified_model(case, world_results):
    check(case, world_results(2, slow=case.id not in FAST)[case.id])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[4], ids=[c.id for c in CASES[4]])
def test_cp4_equals_the_unmodified_model(case, world_results):
    check(case, world_results(4)[case.id])


# ---- errors, on every rank ------------------------------------------------------------------------------------
def _errors():
    pm = wf_mesh.init_parallel(wf_mesh.ParallelDims(cp=dist.get_world_size()))
    outcomes = {}

    def attempt(name, fn):
        try:
            fn()
            outcomes[name] = None
        except Exception as exc:  # sent back as (type, message): an exception chained to model state may not pickle
            outcomes[name] = (type(exc), str(exc))

    attempt("unknown", lambda: apply_context_parallel(torch.nn.Linear(2, 2), mesh=pm))
    attempt("method", lambda: apply_context_parallel(build("wan"), mesh=pm, method="zigzag"))
    attempt("ulysses", lambda: apply_context_parallel(build("wan", num_attention_heads=3), mesh=pm, method="ulysses"))
    attempt("token_replace", lambda: apply_context_parallel(build("hunyuan", image_condition_type="token_replace")))
    model = apply_context_parallel(build("wan"), mesh=pm)
    attempt("twice", lambda: apply_context_parallel(model, mesh=pm))
    kwargs = inputs("wan", "even", torch.float32)
    attempt("per_token_timestep", lambda: model(**{**kwargs, "timestep": torch.full((1, 12), 500)}))
    model.set_attn_processor(diffusers.models.transformers.transformer_wan.WanAttnProcessor())
    attempt("replaced", lambda: model(**kwargs))
    remove_context_parallel(model)
    attempt("removed_twice", lambda: remove_context_parallel(model))
    # removed: the model is the unmodified one again
    plain = model(**kwargs, return_dict=False)[0]
    pm.destroy()
    return outcomes, plain.detach()


def test_errors_on_every_rank():
    results = run_distributed(2, _errors)
    outcomes = [r[0] for r in results]
    names = "|".join(SUPPORTED_MODELS)

    def on_all(name, error, match):
        for rank, o in enumerate(outcomes):
            assert o[name] is not None, f"rank {rank}: {name} did not raise"
            kind, message = o[name]
            assert issubclass(kind, error) and re.search(match, message), (rank, name, kind, message)

    on_all("unknown", TypeError, f"Linear is not a model it knows; supported: .*({names})")
    on_all("method", ValueError, "method='zigzag': use one of 'ring', 'ulysses'")
    on_all("ulysses", ValueError, r"heads \(3\) divisible by the cp size \(2\)")
    on_all("token_replace", ValueError, "token_replace")
    on_all("twice", StateError, "already context-parallel")
    on_all("per_token_timestep", ValueError, "per-token timestep")
    on_all("replaced", StateError, "processors were replaced")
    on_all("removed_twice", StateError, "not context-parallel")
    want = build("wan")(**inputs("wan", "even", torch.float32), return_dict=False)[0]
    for _, plain in results:
        assert torch.allclose(plain, want, atol=1e-6)
