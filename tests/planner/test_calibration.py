import random

import pytest

from specula.planner.calibration import CalibrationConfig, Calibrator


def test_fresh_bins_return_the_raw_score():
    cal = Calibrator()
    assert cal.estimate("draft-model", 0.73) == pytest.approx(0.73)


def test_calibration_converges_to_the_true_acceptance_rate_per_source_and_bin():
    rng = random.Random(0)
    cal = Calibrator(CalibrationConfig(bins=10, prior_strength=4.0))
    # A drafter that is overconfident: true acceptance = raw^2; another that is exact.
    for _ in range(20000):
        raw = rng.random()
        cal.update("over", raw, rng.random() < raw * raw)
        cal.update("exact", raw, rng.random() < raw)
    for raw in (0.15, 0.45, 0.85):
        lo, hi = int(raw * 10) / 10, int(raw * 10) / 10 + 0.1
        true_over = (hi ** 3 - lo ** 3) / 3 / (hi - lo)  # mean of raw^2 over the bin
        assert cal.estimate("over", raw) == pytest.approx(true_over, abs=0.03)
        assert cal.estimate("exact", raw) == pytest.approx((lo + hi) / 2, abs=0.03)


def test_counts_decay_so_estimates_follow_drift():
    cal = Calibrator(CalibrationConfig(bins=1, prior_strength=1.0, max_trials=100))
    for _ in range(500):
        cal.update("s", 0.5, True)
    for _ in range(500):
        cal.update("s", 0.5, False)
    assert cal.estimate("s", 0.5) < 0.1


def test_source_mean_is_the_smoothed_acceptance_over_all_bins():
    cal = Calibrator(CalibrationConfig(prior_strength=4.0))
    assert cal.mean("x", prior=0.5) == 0.5
    for raw, accepted in [(0.1, False), (0.9, True), (0.5, True), (0.5, False)] * 25:
        cal.update("x", raw, accepted)
    assert cal.mean("x", prior=0.5) == pytest.approx((50 + 2) / (100 + 4))


def test_best_children_are_counted_on_their_own():
    """A wide tree's unlikely siblings pull the mean down; the best children keep their own rate."""
    cal = Calibrator(CalibrationConfig(prior_strength=1.0))
    for _ in range(200):  # below max_trials: no decay
        cal.update("head", 0.6, True, best=True)  # the best child: accepted
        for _ in range(7):
            cal.update("head", 0.05, False)  # its siblings: never
    assert cal.mean("head") < 0.15
    assert cal.mean("head", best=True) > 0.99
    assert Calibrator().mean("fresh", prior=0.8, best=True) == pytest.approx(0.8)
