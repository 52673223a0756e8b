"""The message-hop bench's pure parts and its rally between two real actors (no timing checked)."""

from __future__ import annotations

import anyio
import pytest

from bench.hop import hops_us, percentile, rally


def test_hops_are_the_gaps_between_consecutive_arrivals_in_microseconds() -> None:
    assert hops_us([1.0, 1.000002, 1.000007]) == pytest.approx([2.0, 5.0])
    assert hops_us([1.0]) == []


def test_percentile_interpolates_between_samples() -> None:
    values = [float(v) for v in range(1, 102)]  # 1..101: the p-th percentile is p + 1
    assert percentile(values, 50) == pytest.approx(51.0)
    assert percentile(values, 90) == pytest.approx(91.0)
    assert percentile([1.0, 2.0], 50) == pytest.approx(1.5)


@pytest.mark.anyio
async def test_arally_stamps_every_arrival_in_order_and_stops() -> None:
    with anyio.fail_after(10):
        stamps = await rally(50)
    assert len(stamps) == 50
    assert stamps == sorted(stamps)
