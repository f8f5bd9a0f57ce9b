"""Downsampling that keeps spikes, precomputed so that a million-point series reads as a few thousand rows.

A chart of a long run shows, per bucket of steps, the lowest and highest value, the last one, and
the first NaN (a diverged step is the worst spike of all): an average or a random sample would
hide exactly what a user looks for. A `Summary` holds those for a range of steps, and summaries
merge: the summary of a bucket is the merge of its halves'. Ingest keeps summaries of buckets of
16, 256, 4,096 and 65,536 steps (levels 1–4), each level built from the one below, so a query
reads the finest level that has few enough buckets and merges them down to `max_points`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FANOUT = 16
LEVELS = (1, 2, 3, 4)


def width(level: int) -> int:
    """Steps per bucket at `level` (level 0 is the raw points)."""
    return FANOUT**level


@dataclass  # not frozen: a chart builds thousands per request, and a frozen one costs ~9× as much to make
class Summary:
    """What a chart needs of a range of steps. Values are None for a NaN or infinite point. Not
    changed once made."""

    count: int
    first_step: int
    min_step: int | None  # of the lowest finite value; None when every value is NaN
    min_value: float | None
    max_step: int | None
    max_value: float | None
    last_step: int
    last_value: float | None
    null_step: int | None  # the first step whose value is NaN, if any

    @classmethod
    def of_point(cls, step: int, value: float | None) -> Summary:
        return cls.of_points([(step, value)])

    @classmethod
    def of_points(cls, points: Sequence[tuple[int, float | None]]) -> Summary:
        """The summary of (step, value) points in step order."""
        finite = [(value, step) for step, value in points if value is not None]
        low, high = (min(finite), max(finite, key=lambda p: (p[0], -p[1]))) if finite else ((None, None), (None, None))
        return cls(
            count=len(points),
            first_step=points[0][0],
            min_step=low[1], min_value=low[0],
            max_step=high[1], max_value=high[0],
            last_step=points[-1][0], last_value=points[-1][1],
            null_step=next((step for step, value in points if value is None), None),
        )

    def points(self) -> list[tuple[int, float | None]]:
        """The points kept of this range, in step order."""
        kept = {self.last_step: self.last_value}
        if self.min_step is not None:
            kept[self.min_step] = self.min_value
            kept[self.max_step] = self.max_value
        if self.null_step is not None:
            kept[self.null_step] = None
        return sorted(kept.items())


def merge(summaries: Sequence[Summary]) -> Summary:
    """One summary of consecutive ranges (in step order)."""
    # One loop, not a min() and a max() with key functions: a chart merges thousands of these per
    # request. Ties go to the earlier range, as min() and max() would.
    low = high = None
    null_step = None
    for summary in summaries:
        if summary.min_step is not None:
            if low is None or (summary.min_value, summary.min_step) < (low.min_value, low.min_step):
                low = summary
            if high is None or (summary.max_value, -summary.max_step) > (high.max_value, -high.max_step):
                high = summary
        if summary.null_step is not None and (null_step is None or summary.null_step < null_step):
            null_step = summary.null_step
    last = summaries[-1]
    return Summary(
        count=sum(s.count for s in summaries),
        first_step=summaries[0].first_step,
        min_step=low.min_step if low else None,
        min_value=low.min_value if low else None,
        max_step=high.max_step if high else None,
        max_value=high.max_value if high else None,
        last_step=last.last_step,
        last_value=last.last_value,
        null_step=null_step,
    )


def downsample(summaries: Sequence[Summary], max_points: int) -> tuple[list[int], list[float | None]]:
    """At most about `max_points` points (a bucket's first NaN may add one) of these step-ordered
    summaries: merged into max_points // 3 groups when there are more."""
    points = [point for summary in summaries for point in summary.points()]
    if len(points) > max_points:
        groups = max(1, max_points // 3)
        size = -(-len(summaries) // groups)
        points = [point for start in range(0, len(summaries), size) for point in merge(summaries[start : start + size]).points()]
    return [step for step, _ in points], [value for _, value in points]
