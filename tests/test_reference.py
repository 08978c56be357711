import pytest
import torch

from conformance import BASE_CASES, check_dense


@pytest.mark.parametrize("case", BASE_CASES, ids=str)
def test_reference_matches_fp64_math(case):
    check_dense("reference", case)
