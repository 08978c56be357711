import pytest


@pytest.fixture(autouse=True)
def _static_priority(monkeypatch):
    """The GPU tier checks the kernels under the static priority (gluon where it prefers, else triton);
    a measured selection table could hand a cell to SDPA and leave a kernel untested.  The table's own
    choice is checked by `flashport bench --auto-vs-best`."""
    monkeypatch.setenv("FLASHPORT_TABLE", "off")
    # and without cuDNN-first (backend/triton.py cudnn_first: static priority would hand most dense 16-bit calls
    # on Hopper to cuDNN); the default path, cuDNN included, is the operability tier's and the fuzz's with it on
    monkeypatch.setenv("FLASHPORT_CUDNN_FIRST", "0")
