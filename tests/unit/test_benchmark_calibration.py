"""The benchmarks' network calibration helpers: pooling ``gloo_host.py`` runs, the host's
capacity, and the ``pipedream simulate`` options made from them (``benchmarks/``)."""

from __future__ import annotations

import doctest
import json
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gloo_host  # noqa: E402
import simulator_accuracy  # noqa: E402

MIB32 = 32 * 2**20


def _calibration(processes: int, each_ms: dict[str, list[float]]) -> dict:
    """A ``gloo_host.py`` result as it writes one (``ms``: each pattern's median)."""
    times = {name: sorted(trials)[len(trials) // 2] for name, trials in each_ms.items()}
    return {
        "bytes": MIB32,
        "processes": processes,
        "ms": times,
        "capacity_bytes_per_s": gloo_host.capacity(times, processes),
        "each_ms": each_ms,
    }


@pytest.mark.parametrize("module", [gloo_host, simulator_accuracy])
def test_doctests(module) -> None:
    failed, attempted = doctest.testmod(module)
    assert attempted > 0 and failed == 0


def test_capacity_counts_only_patterns_on_different_links() -> None:
    # 4 processes: "2 pairs" moves 2 x 32 MiB in 20 ms, "chain of 3" 3 x 32 MiB in 40 ms
    times = {"one": 10.0, "both ways": 15.0, "2 pairs": 20.0, "chain of 3": 40.0}
    expected = (2 * MIB32 / 0.020 + 3 * MIB32 / 0.040) / 2
    assert gloo_host.capacity(times, 4) == pytest.approx(expected)
    assert gloo_host.capacity({"one": 10.0, "both ways": 15.0}, 2) is None


def test_session_calibration_pools_every_repeat() -> None:
    first = _calibration(
        4,
        {
            "one": [10.0, 11.0, 40.0],
            "both ways": [20.0, 21.0, 22.0],
            "2 pairs": [30.0, 30.0, 30.0],
            "chain of 3": [50.0, 50.0, 50.0],
            "one after quiet": [15.0, 45.0, 44.0],
        },
    )
    second = _calibration(
        4,
        {
            "one": [12.0, 13.0, 14.0],
            "both ways": [23.0, 24.0, 25.0],
            "2 pairs": [20.0, 20.0, 20.0],
            "chain of 3": [40.0, 40.0, 40.0],
            "one after quiet": [16.0, 17.0, 18.0],
        },
    )
    pooled = simulator_accuracy.session_calibration([first, second])
    # the medians of the 6 repeats, not the mean of the two medians (44.0 and 17.0: 30.5)
    assert pooled["ms"] == {
        "one": 12.5,
        "both ways": 22.5,
        "2 pairs": 25.0,
        "chain of 3": 45.0,
        "one after quiet": 17.5,
    }
    assert pooled["processes"] == 4
    assert pooled["capacity_bytes_per_s"] == pytest.approx(
        (2 * MIB32 / 0.025 + 3 * MIB32 / 0.045) / 2
    )
    assert pooled["each_ms"]["one after quiet"] == [15.0, 45.0, 44.0, 16.0, 17.0, 18.0]


def test_session_calibration_takes_a_median_where_repeats_were_not_recorded() -> None:
    older = {"processes": 2, "ms": {"one": 20.0, "both ways": 30.0}, "capacity_bytes_per_s": None}
    newer = _calibration(2, {"one": [10.0, 12.0], "both ways": [25.0, 27.0]})
    pooled = simulator_accuracy.session_calibration([older, newer])
    assert pooled["ms"] == {"one": 12.0, "both ways": 27.0}
    assert pooled["capacity_bytes_per_s"] is None


def test_a_case_pools_the_calibrations_of_its_size_and_hour() -> None:
    hour = simulator_accuracy.SESSION_S
    own = [(1000.0, _calibration(2, {"one": [10.0]})), (1100.0, _calibration(2, {"one": [14.0]}))]
    everyone = [
        *own,
        (1050.0 + hour, _calibration(2, {"one": [30.0]})),  # the same run, an hour on
        (1051.0 + hour, _calibration(2, {"one": [90.0]})),  # a run read back from later
        (1050.0, _calibration(4, {"one": [50.0]})),  # another number of processes
    ]
    pooled = simulator_accuracy.session_around(own, everyone)
    assert pooled["processes"] == 2
    assert pooled["each_ms"]["one"] == [10.0, 14.0, 30.0]
    assert pooled["ms"] == {"one": 14.0}


def test_calibrations_are_read_with_when_they_were_written(tmp_path: Path) -> None:
    for when, at in (("before", 1000.0), ("after", 1060.0)):
        path = tmp_path / f"gloo-host-{when}.json"
        path.write_text(json.dumps(_calibration(2, {"one": [at / 100]})))
        os.utime(path, (at, at))
    timed = simulator_accuracy.timed_calibrations(tmp_path)
    assert [(when, calibration["ms"]) for when, calibration in timed] == [
        (1000.0, {"one": 10.0}),
        (1060.0, {"one": 10.6}),
    ]
    assert simulator_accuracy.timed_calibrations(tmp_path / "missing") == []


def test_network_options_from_a_pooled_calibration() -> None:
    pooled = simulator_accuracy.session_calibration(
        [
            _calibration(
                4,
                {
                    "one": [16.0],
                    "both ways": [25.6],
                    "2 pairs": [20.0],
                    "chain of 3": [40.0],
                    "one after quiet": [20.0],
                },
            )
        ]
    )
    argv, described = simulator_accuracy.network([pooled], latency_ms=0.5, large_ms=13.0)
    options = dict(zip(argv[::2], argv[1::2]))
    assert options["--bandwidth"] == f"{MIB32 / 0.020:.0f}"  # the message after quiet
    assert options["--duplex"] == "1.250"  # 2 x 16 / 25.6
    assert options["--per-rank"] == "1"
    assert described.startswith("32 MiB in 20.0 ms after quiet, host ")
