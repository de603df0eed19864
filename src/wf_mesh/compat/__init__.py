"""Drop-in module trees of other packages, thin aliases of wf_mesh names.

``wf_mesh.compat.worldfoundry`` mirrors ``worldfoundry.core.distributed``: replace that import prefix with
``wf_mesh.compat.worldfoundry``, or call ``wf_mesh.compat.worldfoundry.install()`` once to keep the old imports.
"""
