"""``worldfoundry.core.distributed.pipeline_parallel``: the legacy point-to-point pipeline scheduler."""

from wf_mesh.legacy.pipeline import PPScheduler, init_pp_scheduler, pp_scheduler

__all__ = ["PPScheduler", "init_pp_scheduler", "pp_scheduler"]
