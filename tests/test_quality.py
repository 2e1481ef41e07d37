"""The paired quality change: its interval covers what it should and decides only what it can."""
import math

import pytest

from efflab import quality


def rows(nlls, tokens=10):
    return [[tokens, n] for n in nlls]


def test_a_uniform_rise_has_a_tight_interval_around_it():
    ref = rows([20.0 + i for i in range(8)])
    var = rows([20.0 + i + 1.0 for i in range(8)])  # +0.1 nats per token on every row
    c = quality.paired_change(ref, var)
    assert c["change_pct"] == pytest.approx(100 * math.expm1(0.1))
    lo, hi = c["ci95_change_pct"]
    assert lo == pytest.approx(hi) == pytest.approx(c["change_pct"])
    assert quality.against_tolerance(c, 5.0) == "beyond" and quality.direction(c) == "worse"
    assert quality.against_tolerance(c, 20.0) == "within"


def test_noise_around_zero_is_no_difference_and_straddles_a_small_tolerance():
    ref = rows([20.0] * 8)
    var = rows([20.0 + d for d in (0.5, -0.5, 0.4, -0.4, 0.3, -0.3, 0.2, -0.2)])
    c = quality.paired_change(ref, var)
    assert c["change_pct"] == pytest.approx(0.0, abs=1e-12)
    assert quality.direction(c) == "no difference measured"
    assert quality.against_tolerance(c, 0.1) == "undecided"
    assert quality.against_tolerance(c, 5.0) == "within"


def test_too_few_rows_give_no_interval_and_decide_nothing():
    c = quality.paired_change(rows([20.0] * 5), rows([30.0] * 5))
    assert c["ci95_change_pct"] is None and c["n_rows"] == 5
    assert quality.against_tolerance(c, 1.0) == "undecided" and quality.direction(c) == "undecided"


def test_rows_must_pair_token_for_token():
    with pytest.raises(ValueError, match="same rows"):
        quality.paired_change([[10, 1.0]] * 6, [[11, 1.0]] * 6)


def test_the_interval_covers_the_true_change_about_95_percent_of_the_time():
    import random

    rng, hits, trials = random.Random(0), 0, 400
    for _ in range(trials):
        tokens = [rng.randint(5, 40) for _ in range(16)]
        ref = [[t, 2.0 * t + rng.gauss(0, 1)] for t in tokens]
        var = [[t, n + 0.05 * t + rng.gauss(0, 0.3 * math.sqrt(t))] for (t, n) in ref]
        lo, hi = quality.paired_change(ref, var)["ci95_loss_change"]
        hits += lo <= 0.05 <= hi
    assert 0.90 <= hits / trials <= 0.99
