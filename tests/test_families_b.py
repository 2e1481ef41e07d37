"""The supported-architecture matrix (tests/matrix.py), part b: a mixture of experts, fused query_key_value
and Conv1D projections, Bloom's ALiBi."""
from __future__ import annotations

import pytest

from tests.matrix import GROUPS, check_family, tokenizer_folder  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.matrix, pytest.mark.integration]  # make test-integration


@pytest.mark.parametrize("family", GROUPS["b"])
def test_every_stage_runs_or_says_why(family, tmp_path, tokenizer_folder):  # noqa: F811
    check_family(family, tmp_path, tokenizer_folder)
