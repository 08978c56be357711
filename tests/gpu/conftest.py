import pytest


@pytest.fixture(autouse=True)
def _static_priority(monkeypatch):
    """The GPU tier checks the kernels under the static priority (gluon where it prefers, else triton);
    a measured selection table could hand a cell to SDPA and leave a kernel untested.  The table's own
    choice is checked by `flashport bench --auto-vs-best`."""
    monkeypatch.setenv("FLASHPORT_TABLE", "off")
