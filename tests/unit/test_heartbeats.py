"""Hosts that start together do not beat together: their heartbeats (lease renewals, an idle host's
heartbeat) spread over the period, as the worker times them (workers/supervisor.py heartbeat_pause)."""

from __future__ import annotations

from collections import Counter

from workers.supervisor import HEARTBEAT_JITTER, heartbeat_pause

HEARTBEAT = 5.0


def renewal_times(started_at: float, periods: int) -> list[float]:
    """One attempt's syncs as the worker times them: the first at its claim, the next anywhere within
    a heartbeat, then a little less than a heartbeat apart."""
    times = [started_at]
    times.append(times[-1] + heartbeat_pause(HEARTBEAT, first=True))
    while len(times) < periods + 2:
        times.append(times[-1] + heartbeat_pause(HEARTBEAT))
    return times


def test_each_pause_is_within_its_period_and_never_longer():
    firsts = [heartbeat_pause(HEARTBEAT, first=True) for _ in range(2000)]
    laters = [heartbeat_pause(HEARTBEAT) for _ in range(2000)]
    assert all(0 <= pause <= HEARTBEAT for pause in firsts)
    assert min(firsts) < 0.1 * HEARTBEAT and max(firsts) > 0.9 * HEARTBEAT  # anywhere within it
    # A lease is renewed at least as often as the service's terms say: never later than a heartbeat.
    assert all((1 - HEARTBEAT_JITTER) * HEARTBEAT <= pause <= HEARTBEAT for pause in laters)


def test_five_hundred_attempts_claimed_in_one_second_renew_a_hundred_a_second_not_all_at_once():
    # A sweep's 500 trials placed in one scheduler pass and claimed within the same second: with a
    # fixed period they renewed together every 5 s for as long as they ran (500 requests in one second
    # of each five, each waiting behind the others at the API).
    schedules = [renewal_times(started_at=i / 500, periods=12) for i in range(500)]
    window = (30.0, 55.0)  # past the start, five periods
    per_second = Counter(int(t) for times in schedules for t in times if window[0] <= t < window[1])
    mean = sum(per_second.values()) / (window[1] - window[0])
    assert 90 <= mean <= 125  # 500 renewals every 4.5 s on average
    assert max(per_second.values()) < 2 * mean, per_second
