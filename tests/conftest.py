import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# `pytest -n 2` on a 2-core box: two workers with 2 OpenMP threads each oversubscribe the cores, and
# OpenMP's spinning barriers then make mid-sized ops up to 100x slower.  One thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_selection():
    """Dispatch memoises its choices per call description; a test that patches a backend must not see
    a choice memoised before the patch (nor leave one behind)."""
    from flashport import dispatch, table
    dispatch.clear_cache()
    table.reload()
    yield
    dispatch.clear_cache()
    table.reload()
