"""`shoal top`'s view of two readings: the straggler mark needs a 10% gap in waiting (noise
between equal ranks names nobody), and a rank the others wait for is marked as hung with a
line naming who waits and for how long."""

from __future__ import annotations

from shoal.launcher.top import Reading, render

WAIT = "shoal_collectives_wait_seconds_total"
WAITING = "shoal_collectives_waiting_for_rank_since_timestamp_seconds"


def _reading(at: float, waits: dict, extra: dict = ()) -> Reading:
    samples = {(WAIT, (("rank", r),)): v for r, v in waits.items()}
    samples.update(dict(extra))
    return Reading(at, samples)


def _rows(lines):
    return {line.split()[0]: line for line in lines[3:] if line.strip()[:1].isdigit()}


def test_a_wait_gap_under_ten_percent_names_no_straggler():
    # Over 10 s rank 0 waited 5.0 s and rank 1 4.6 s: 4% of the time apart.
    lines = render("u", _reading(0, {"0": 0, "1": 0}), _reading(10, {"0": 5.0, "1": 4.6}))
    assert not any("straggler" in line for line in lines), lines


def test_a_wait_gap_over_ten_percent_marks_the_rank_that_waits_least():
    lines = render("u", _reading(0, {"0": 0, "1": 0}), _reading(10, {"0": 6.0, "1": 1.0}))
    rows = _rows(lines)
    assert rows["1"].endswith("<- straggler") and "straggler" not in rows["0"], lines


def test_a_rank_the_others_wait_for_is_marked_hung_with_who_waits():
    waiting = {(WAITING, (("peer", "1"), ("rank", "0"))): 88.0,
               (WAITING, (("peer", "1"), ("rank", "2"))): 90.0,
               (WAITING, (("peer", "2"), ("rank", "0"))): 0.0}  # set back to 0: not waiting
    lines = render("u", _reading(0, {"0": 0, "1": 0, "2": 0}),
                   _reading(100, {"0": 9.0, "1": 0.1, "2": 9.0}, waiting))
    rows = _rows(lines)
    assert rows["1"].endswith("<- hung"), lines
    assert not rows["0"].endswith("hung") and not rows["2"].endswith("hung"), lines
    assert "rank 1 holds up the job: ranks 0, 2 waited for it inside a collective for 12.0s" \
        in lines, lines
