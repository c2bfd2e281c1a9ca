"""The windowed (min, max) product is exact: brute force on random matrices and bounds."""
# ruff: noqa: E741 -- I and J are the standard names of the start and end indices

from __future__ import annotations

import numpy as np
import pytest

from pipedream.optimizer.minmax import minmax_product, suffix_envelope


def random_problem(seed: int, *, single: bool):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 30))
    # stage times: a monotone lower bound from q_key plus nonnegative noise, some infinite
    q_key = np.concatenate(([0.0], np.cumsum(rng.choice([0.0, 1.0, 3.0], size=n))))
    lower = q_key[None, 1:] - q_key[:-1, None]
    Q = lower + rng.exponential(rng.choice([0.1, 2.0, 20.0]), size=(n, n))
    Q[rng.random((n, n)) < 0.1] = np.inf
    start = int(rng.integers(0, n - 1))
    rows_count = 1 if single else n
    P = rng.exponential(10.0, size=(rows_count, n)) + rng.choice([0.0, 5.0]) * np.arange(n)
    P[rng.random(P.shape) < 0.15] = np.inf
    if single:
        J = np.arange(start + 1, n)
        I = np.full(len(J), start)
        rows = np.zeros(len(J), dtype=np.int64)
    else:
        I, J = np.triu_indices(n, 1)
        rows = I.copy()
    if not single:
        for i in range(n):  # a prefix table is infinite before its start
            P[i, :i] = np.inf
    return P, Q, rows, I.astype(np.int64), J.astype(np.int64), q_key, rng


def brute(P, Q, rows, I, J):
    values, args = [], []
    for row, i, j in zip(rows, I, J):
        ks = np.arange(i, j)
        candidates = np.maximum(P[row, ks], Q[ks + 1, j])
        values.append(candidates.min())
        args.append(int(ks[np.argmin(candidates)]))
    return np.array(values), np.array(args)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("single", [False, True])
def test_windowed_product_is_exact(seed: int, single: bool) -> None:
    P, Q, rows, I, J, q_key, rng = random_problem(seed, single=single)
    expected, expected_arg = brute(P, Q, rows, I, J)
    gather = lambda x, y: Q[x, y]  # noqa: E731
    for q_flat in (None, Q.ravel()):
        value, arg, kept = minmax_product(
            P,
            gather,
            envelope=suffix_envelope(P),
            rows=rows,
            I=I,
            J=J,
            q_key=q_key,
            q_flat=q_flat,
            want_argmin=True,
        )
        assert kept is None
        np.testing.assert_array_equal(value, expected)
        finite = np.isfinite(expected)
        np.testing.assert_array_equal(arg[finite], expected_arg[finite])  # earliest on ties
    # with a cutoff, skipped entries are exactly those that could not beat it
    cutoff = np.where(rng.random(len(I)) < 0.5, expected * rng.uniform(0.5, 1.5), np.inf)
    value, _, kept = minmax_product(
        P, gather, envelope=suffix_envelope(P), rows=rows, I=I, J=J, q_key=q_key, cutoff=cutoff
    )
    computed = np.arange(len(I)) if kept is None else kept
    np.testing.assert_array_equal(value, expected[computed])
    skipped = np.setdiff1d(np.arange(len(I)), computed)
    assert np.all(expected[skipped] >= cutoff[skipped] * (1 - 1e-9))


def test_suffix_envelope() -> None:
    P = np.array([[3.0, 1.0, 2.0, np.inf], [np.inf, 5.0, 4.0, 6.0]])
    np.testing.assert_array_equal(suffix_envelope(P), [[1, 1, 2, np.inf], [4, 4, 4, 6]])
