"""The fair-share arithmetic (service/fair_share.py): usage decays with its half-life, the factor is
2^(-usage share / entitled share), and borrowed slots are reclaimed newest first, never below a quota."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from service.db.teams import decay_and_add, usage_key
from service.fair_share import FairShare, Quotas

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
DAY = 24 * 3600.0


def test_usage_halves_each_half_life_and_running_time_is_added_as_it_runs():
    usage = {usage_key(1, 7, "cuda"): 1000.0}
    later = decay_and_add(usage, T0, T0 + timedelta(days=7), 7 * DAY, [])
    assert later[usage_key(1, 7, "cuda")] == pytest.approx(500.0)
    # 2 GPUs for the last hour (started before the last update: only the time since counts), still running.
    ran = [(2, None, "cuda", 2, T0 - timedelta(hours=5), None)]
    assert decay_and_add({}, T0, T0 + timedelta(hours=1), 7 * DAY, ran) == {usage_key(2, None, "cuda"): pytest.approx(7200.0)}


def test_a_claimant_at_its_entitlement_gets_half_and_one_that_used_nothing_gets_all():
    quotas = Quotas(nominal={1: {"cuda": 6}, 2: {"cuda": 2}}, names={1: "big", 2: "small"})
    # Team 1 is entitled to 3/4 and used 3/4; team 2, entitled to 1/4, used 1/4 (one user of two).
    shares = FairShare({usage_key(10, 1, "cuda"): 300.0, usage_key(20, 2, "cuda"): 100.0}, quotas, waiting={(21, 2, "cuda")})
    assert shares.team_factor(1, "cuda") == pytest.approx(0.5) and shares.team_factor(2, "cuda") == pytest.approx(0.5)
    assert shares.factor(20, 2, "cuda") == pytest.approx(0.5 * 0.5 ** 2)  # all of team 2's usage, entitled to half of it
    assert shares.factor(21, 2, "cuda") == pytest.approx(0.5)  # nothing used yet
    assert shares.team_factor(3, "cuda") == 1.0  # unused: nothing to hold against it


def test_borrowed_slots_are_the_newest_attempts_beyond_a_quota_and_never_more_but_for_one_that_crossed_the_line():
    quotas = Quotas(nominal={1: {"cpu": 2}, 2: {"cpu": 2}}, names={1: "a", 2: "b"})
    running = [(1, 1, "cpu", 1), (2, 1, "cpu", 2), (3, 1, "cpu", 1), (4, 2, "cpu", 1)]
    for _, team, device, slots in running:
        quotas.take(team, device, slots)
    # Team 1 holds 4 against its 2, newest first: attempt 3 (1 slot) is borrowed; attempt 2's 2 slots would take
    # the team below its quota, so it is kept; attempt 1's one slot is the other borrowed one.
    assert quotas.reclaimable(running) == {3, 1}
    # A team of quota 1 whose one attempt holds 2: that attempt crossed the quota line, so it borrowed as a whole.
    wide = Quotas(nominal={1: {"cpu": 1}}, names={1: "a"})
    wide.take(1, "cpu", 2)
    assert wide.reclaimable([(7, 1, "cpu", 2)]) == {7}
    assert quotas.borrowed(2, "cpu") == 0 and not quotas.within(2, "cpu", 2) and quotas.within(2, "cpu", 1)
    assert quotas.within(None, "cuda", 100)  # no quota governs GPUs: as without teams

