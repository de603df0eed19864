"""print_rank_0 / print_per_rank: who logs, and the rank and coordinates on every record."""

from loguru import logger

import wf_mesh
from wf_mesh.testing import run_distributed


def capture_logs(with_mesh):
    records = []
    sink = logger.add(lambda m: records.append((m.record["message"], m.record["extra"])), level="INFO")
    try:
        if with_mesh:
            wf_mesh.initialize_model_parallel(tp_size=2)
        wf_mesh.print_rank_0("once")
        wf_mesh.print_per_rank({"step": 3})
    finally:
        logger.remove(sink)
    return records


def test_rank_tagged_records_with_mesh():
    logs = run_distributed(4, capture_logs, True)
    assert logs[0][0] == ("[rank 0 tp0 cp0 pp0 dp0] once", {"rank": 0, "coords": {"tp": 0, "cp": 0, "pp": 0, "dp": 0}})
    assert [len(r) for r in logs] == [2, 1, 1, 1]  # print_rank_0 only on rank 0
    assert logs[3][0] == (
        "[rank 3 tp1 cp0 pp0 dp1] {'step': 3}",
        {"rank": 3, "coords": {"tp": 1, "cp": 0, "pp": 0, "dp": 1}},
    )


def test_rank_tag_without_mesh():
    logs = run_distributed(2, capture_logs, False)
    assert logs[1] == [("[rank 1] {'step': 3}", {"rank": 1, "coords": None})]


def test_safe_without_distributed():
    assert capture_logs(False) == [
        ("once", {"rank": None, "coords": None}),
        ("{'step': 3}", {"rank": None, "coords": None}),
    ]
