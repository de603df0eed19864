"""Integrations of wf_mesh with model libraries (each an optional extra: ``wf_mesh[diffusers]``)."""

__all__: list[str] = []
