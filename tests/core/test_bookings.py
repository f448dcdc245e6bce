"""Bookings: the room admission keeps for refused requests that come back when told."""

from __future__ import annotations

import pytest

from qosgate.core.bookings import Bookings


def test_a_booking_is_taken_by_its_return_from_its_time_on() -> None:
    b = Bookings(2)
    due = b.book("k", 1, now=0.0, earliest=2.0, gap=0.5, horizon=5.0, grace=1.0)
    assert due == 2.0
    assert b.held(1, 0.0) == pytest.approx(0.5)  # weighed by the share that come back (a half)
    assert b.held(0, 0.0) == 0.0
    assert not b.take("k", 1.0)  # too early: it stays booked
    assert b.take("k", 2.0)
    assert not b.take("k", 2.1)  # once
    assert b.held(1, 2.1) == 0.0 and b.kept == 1


def test_bookings_are_spread_one_service_interval_apart() -> None:
    b = Bookings(1)
    dues = [b.book(f"k{i}", 0, now=0.0, earliest=1.0, gap=0.25, horizon=5.0, grace=1.0)
            for i in range(4)]
    assert dues == [1.0, 1.25, 1.5, 1.75]


def test_nothing_is_booked_past_the_horizon() -> None:
    b = Bookings(1)
    for i in range(3):  # at 1, 2 and 3 s
        assert b.book(f"k{i}", 0, now=0.0, earliest=1.0, gap=1.0, horizon=3.0, grace=1.0)
    assert b.book("late", 0, now=0.0, earliest=1.0, gap=1.0, horizon=3.0, grace=1.0) is None
    assert b.made == 3


def test_a_booking_lapses_after_its_grace_and_no_longer_holds_room() -> None:
    b = Bookings(1)
    b.book("gone", 0, now=0.0, earliest=1.0, gap=0.0, horizon=5.0, grace=1.0)
    assert b.held(0, 1.9) > 0
    assert b.held(0, 2.0) == 0.0 and b.lapsed == 1
    assert not b.take("gone", 2.5)


def test_room_is_kept_only_for_the_clients_that_come_back() -> None:
    b = Bookings(1)
    for i in range(40):  # nobody comes back
        b.book(f"k{i}", 0, now=float(i), earliest=float(i) + 1, gap=0.0, horizon=5.0, grace=0.5)
    b.held(0, 100.0)
    assert b.returning < 0.05
    for i in range(40):  # everybody does
        b.book(f"r{i}", 0, now=100.0 + i, earliest=101.0 + i, gap=0.0, horizon=5.0, grace=0.5)
        assert b.take(f"r{i}", 101.0 + i)
    assert b.returning > 0.6


def test_identical_requests_share_their_key_and_take_its_bookings_in_turn() -> None:
    b = Bookings(1)
    b.book("k", 0, now=0.0, earliest=1.0, gap=0.5, horizon=5.0, grace=1.0)
    b.book("k", 0, now=0.2, earliest=1.0, gap=0.5, horizon=5.0, grace=1.0)
    assert b.held(0, 0.5) == pytest.approx(1.0)  # two, weighed by a half
    assert b.take("k", 1.0)  # the earliest
    assert not b.take("k", 1.05)  # the other's time (1.5) has not come
    assert b.take("k", 1.5)
    assert b.held(0, 10.0) == 0.0 and b.lapsed == 0 and b.kept == 2
