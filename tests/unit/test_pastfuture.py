"""Past-Future admission: the length sampler, the exact future peak, admission."""

from __future__ import annotations

import numpy as np

from backend.policy.pastfuture import (
    LengthHistory,
    PeakAdmission,
    PeakTracker,
    future_peak,
    num_sample_lists,
)


def test_future_peak_matches_a_hand_computed_batch() -> None:
    # current tokens 5, 6, 4; remaining 4, 1, 2 → sorted by remaining: (5,4), (4,2), (6,1)
    # M_1 = 5 + 4·1 = 9, M_2 = 9 + 2·2 = 13, M_3 = 15 + 1·3 = 18
    assert future_peak(np.array([5, 6, 4]), np.array([4, 1, 2])) == 18
    assert future_peak(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == 0


def test_peak_is_never_below_current_use() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        cur, rem = rng.integers(1, 100, 20), rng.integers(0, 100, 20)
        assert future_peak(cur, rem) >= cur.sum()


def test_unconditional_samples_come_from_the_history() -> None:
    history = LengthHistory(window=10, prior=[10, 20, 30])
    samples = history.sample_total(np.random.default_rng(0), np.zeros(2000, dtype=np.int64), 100)
    assert samples.min() >= 0 and samples.max() <= 100
    # piecewise-linear inverse CDF through 0, 10, 20, 30, 100: the median is near 20
    assert 15 <= np.median(samples) <= 25


def test_conditional_samples_exceed_what_was_generated() -> None:
    history = LengthHistory(prior=[50] * 100 + [400] * 100)
    gen = np.full(1000, 60)
    samples = history.sample_total(np.random.default_rng(0), gen, 1000)
    assert (samples >= 60).all()
    assert np.mean(samples) > 300  # past 50 tokens, the long mode dominates


def test_beyond_every_recorded_length_the_prediction_is_uniform_up_to_the_cap() -> None:
    history = LengthHistory(prior=[10, 20])
    samples = history.sample_total(np.random.default_rng(0), np.full(4000, 500), 1000)
    assert samples.min() >= 500 and samples.max() <= 1000
    assert abs(np.mean(samples) - 750) < 15


def test_window_forgets_old_lengths() -> None:
    history = LengthHistory(window=3, prior=[1, 1, 1])
    history.extend([9, 9, 9])
    assert history.sorted_values().tolist() == [9, 9, 9]


def test_more_sample_lists_for_small_batches() -> None:
    assert num_sample_lists(1) == 5 and num_sample_lists(100) == 3
    assert num_sample_lists(1000) == 1


def test_admission_refuses_what_would_overflow_in_the_future() -> None:
    # two running requests: 10 tokens each, 10 more to go → peak 40 over a limit of 45
    check = PeakAdmission(np.array([10, 10]), np.array([[10, 10]]), limit_tokens=45)
    assert check.peak == 40
    # fits now (25 + 5 = 30 ≤ 45) but would need 10 + 10 + 5 + 3·10 = 55 later: refused
    assert not check.try_admit(5, np.array([10]))
    assert check.try_admit(5, np.array([0]))  # a short one fits
    assert check.peak == 40  # it finishes before the peak


def test_admission_uses_the_worst_sample_list() -> None:
    check = PeakAdmission(np.array([10]), np.array([[0], [30]]), limit_tokens=45)
    assert check.peak == 40
    # list 1 alone would allow it (peak 20); list 2 peaks at 10+10 + 20·2 = 60 > 45
    assert not check.try_admit(10, np.array([0, 20]))


def test_admission_peaks_are_future_peak_of_the_set_with_the_candidate() -> None:
    """`PeakAdmission` answers every list at once; each answer must be `future_peak`'s (and
    `PeakTracker`'s) exactly, ties and admitted candidates included: the Table-1 simulator's
    results depend on every comparison with the limit."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        size, lists = int(rng.integers(0, 12)), int(rng.integers(1, 6))
        cur = rng.integers(0, 50, size)
        rem = rng.integers(0, int(rng.integers(1, 30)), (lists, size))  # small ranges: ties
        check = PeakAdmission(cur, rem, limit_tokens=float(rng.integers(0, 600)))
        trackers = [PeakTracker.from_arrays(cur, row) for row in rem]
        for _ in range(int(rng.integers(1, 8))):
            assert check.peak == max(future_peak(cur, row) for row in rem)
            c, r = int(rng.integers(0, 50)), rng.integers(0, 30, lists)
            expected = max(t.peak_with((c, int(r[i]))) for i, t in enumerate(trackers))
            assert expected == max(
                future_peak(np.append(cur, c), np.append(row, r[i])) for i, row in enumerate(rem)
            )
            assert check.peak_with(c, r) == expected
            if check.try_admit(c, r):
                assert expected <= check.limit_tokens
                cur, rem = np.append(cur, c), np.hstack([rem, r[:, None]])
                for i, t in enumerate(trackers):
                    t.add((c, int(r[i])))
            else:
                assert expected > check.limit_tokens


def test_few_draws_take_the_scalar_path_and_give_the_numpy_paths_numbers() -> None:
    """`LengthModel.sample` draws a few requests of one key without numpy (most plans redraw
    only those that outgrew their sample; 10× cheaper per call): the same generator, the same
    order and the same arithmetic, so the simulator's results stay bit-identical."""
    from types import SimpleNamespace

    from backend.policy.tandem import admission

    def model() -> admission.LengthModel:
        m = admission.LengthModel(window=300, min_samples=10, seed=3)
        rng = np.random.default_rng(7)
        for v in rng.integers(1, 400, 300):
            m.observe("done", "k", int(v))
        return m

    rng = np.random.default_rng(11)
    for _ in range(200):
        n, lists = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        reqs = [
            SimpleNamespace(
                rid=f"r{i}",
                length_key="k",
                max_new_tokens=int(rng.choice([16, 256, 2048])),
                generated=int(rng.integers(0, 600)),
            )
            for i in range(n)
        ]
        scalar, vector = model(), model()
        assert n * lists <= admission.SCALAR_SAMPLES
        fast = scalar.sample(reqs, lists)
        saved, admission.SCALAR_SAMPLES = admission.SCALAR_SAMPLES, 0  # force the numpy path
        try:
            slow = vector.sample(reqs, lists)
        finally:
            admission.SCALAR_SAMPLES = saved
        assert fast.tolist() == slow.tolist()
        assert scalar.rng.random() == vector.rng.random()  # the generator left where it was
