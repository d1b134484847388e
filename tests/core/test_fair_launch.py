"""The launch order of batch runs (defs/run_limits.py fair_ranks): keys interleaved, each key's runs in order,
a key with nothing in flight behind one run slot at most (issue #18)."""

from __future__ import annotations

from batch_dagster.defs.run_limits import InFlight, fair_ranks


def queue_order(runs: list[tuple[str, int]]) -> list[str]:
    """The order the run queue launches (owner, priority) runs in: higher first, submission order among equals."""
    return [owner for owner, _ in sorted(runs, key=lambda run: -run[1])]


def submit(in_flight: list[InFlight], owners: list[str]) -> list[InFlight]:
    """`owners`' new runs, queued with the priorities the sensor gives them."""
    return [InFlight(o, p, False) for o, p in zip(owners, fair_ranks(in_flight, owners), strict=True)]


def test_a_backlog_keeps_its_order_and_a_later_key_goes_next():
    backlog = submit([], ["a"] * 5)
    assert [r.rank for r in backlog] == [0, -1, -2, -3, -4]  # oldest first
    running = [InFlight("a", 0, True), *backlog[1:]]  # a's first run took the one slot
    [b] = submit(running, ["b"])
    queued = [(r.owner, r.rank) for r in running if not r.started] + [(b.owner, b.rank)]
    assert queue_order(queued) == ["b", "a", "a", "a", "a"]  # b waits for that one slot only


def test_backlogs_of_several_keys_interleave_round_robin():
    in_flight = submit([], ["a"] * 4)
    in_flight += submit(in_flight, ["b"] * 3)
    in_flight += submit(in_flight, ["c"])
    assert queue_order([(r.owner, r.rank) for r in in_flight]) == ["a", "b", "c", "a", "b", "a", "b", "a"]


def test_a_key_arriving_late_is_not_behind_the_backlogs_that_ran_meanwhile():
    # a's runs of rank 0..3 have started (the clock is at 3); a still has ranks 4..9 queued.
    in_flight = [InFlight("a", -r, True) for r in range(4)] + [InFlight("a", -r, False) for r in range(4, 10)]
    [b1, b2] = submit(in_flight, ["b", "b"])
    assert (b1.rank, b2.rank) == (-3, -4)  # at the clock, not at the end of a's backlog
    [a_more] = submit(in_flight, ["a"])
    assert a_more.rank == -10  # a's new run after its own backlog


def test_runs_without_a_priority_and_an_empty_queue():
    assert fair_ranks([], ["a", "b", "a"]) == [0, 0, -1]
    # Runs the CLI started (no priority tag: 0) count as started at rank 0.
    assert fair_ranks([InFlight("cli", 0, True)], ["a"]) == [0]
