"""The launch order of batch runs (features/fairness.py fair_ranks): keys interleaved, each key's runs in order,
a key with nothing in flight behind one run slot at most (issue #18); within a priority, the earliest deadline first
(issue #32)."""

from __future__ import annotations

from batch_dagster.features.fairness import (
    PRIORITY_STEP,
    InFlight,
    deadline_term,
    fair_ranks,
    launch_priority,
    own_priority,
)

HOUR, DAY = 3600, 86_400


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


def test_another_models_runs_do_not_move_this_models_clock():
    """a's backlog of model m1 has its first run in m1's one slot; c's runs of m2 have gone far ahead (turn 50 has
    started there). b's first m1 run waits for m1's one slot only, not behind a's whole backlog."""
    m1, m2 = ("m1", 0), ("m2", 0)
    in_flight = [InFlight("a", 0, True, m1), *(InFlight("a", -r, False, m1) for r in range(1, 10))]
    in_flight += [InFlight("c", -r, True, m2) for r in range(51)]
    [b_rank] = fair_ranks(in_flight, ["b"], [m1])
    queued = [(r.owner, r.rank) for r in in_flight if not r.started and r.queue == m1] + [("b", b_rank)]
    assert queue_order(queued) == ["b"] + ["a"] * 9
    [c_more] = fair_ranks(in_flight, ["c"], [m2])
    assert c_more == -51  # after its own runs of m2: the m1 queue moves nothing there


def test_another_prioritys_runs_do_not_move_this_prioritys_clock():
    """High-priority runs of d have run far ahead; at priority 0, b's first run still goes before a's backlog."""
    low, high = ("m", 0), ("m", 5)
    in_flight = [InFlight("a", 0, True, low), *(InFlight("a", -r, False, low) for r in range(1, 6))]
    in_flight += [InFlight("d", -r, True, high) for r in range(30)]
    [b_rank] = fair_ranks(in_flight, ["b"], [low])
    assert b_rank > max(r.rank for r in in_flight if not r.started and r.queue == low)


def test_within_a_priority_the_earliest_deadline_goes_first_and_keys_interleave_among_batches_due_together():
    now = 1_800_000_000
    # a's backlog of 24h batches is queued; then, a minute later, b's 24h batch and c's 1h batch arrive.
    in_flight = submit([], ["a"] * 3)
    [b, c] = fair_ranks(in_flight, ["b", "c"])
    runs = [(f"a{i}", launch_priority(r.rank, 0, now + DAY)) for i, r in enumerate(in_flight)]
    runs += [("b", launch_priority(b, 0, now + 60 + DAY)), ("c-1h", launch_priority(c, 0, now + 60 + HOUR))]
    assert queue_order(runs) == ["c-1h", "a0", "b", "a1", "a2"]
    # A 24h batch created 23.5 h ago is due before a 1h batch created now: earliest deadline, not shortest window.
    runs += [("old-24h", launch_priority(0, 0, now + HOUR // 2))]
    assert queue_order(runs)[:2] == ["old-24h", "c-1h"]
    # A higher priority still goes first, whatever its deadline; no deadline goes after every one.
    runs += [("urgent-24h", launch_priority(-5, 1, now + DAY)), ("cli", launch_priority(0, 0, None))]
    assert queue_order(runs)[0] == "urgent-24h" and queue_order(runs)[-1] == "cli"
    # No deadline (a run with no tag: the command line's) is 0; every deadline the store holds is under a priority.
    assert deadline_term(None) == deadline_term(2**40) == 0 and deadline_term(0) < PRIORITY_STEP // 2
    # A fair rank weighs RANK_DEADLINE_S of deadline: a key's 11th batch goes after another's first due 100 min later.
    assert launch_priority(-10, 0, now) < launch_priority(0, 0, now + 6000 - 1)
    # The sensor reads a run's own priority back from its dagster/priority, whatever its deadline and rank.
    assert [own_priority(launch_priority(r, p, d), r) for r, p, d in [(0, 0, None), (-138, 5, now), (-3, -10, now + DAY)]] \
        == [0, 5, -10]
