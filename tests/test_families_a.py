"""The supported-architecture matrix (tests/matrix.py), part a: Llama-style decoders with separate, biased
and fused projections, and soft-capping; OPT's out_proj and learned positions; Falcon's multi-query fused
query_key_value in FalconLinear layers."""
from __future__ import annotations

import pytest

from tests.matrix import GROUPS, check_family, tokenizer_folder  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.matrix, pytest.mark.integration]  # make test-integration


@pytest.mark.parametrize("family", GROUPS["a"])
def test_every_stage_runs_or_says_why(family, tmp_path, tokenizer_folder):  # noqa: F811
    check_family(family, tmp_path, tokenizer_folder)
