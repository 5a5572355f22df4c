"""Replay buffers and adaptive hints against hand-worked schedules: U-RB releases the next queries in
arrival order only once complete (a later, finished batch waits), continues long responses over
rounds and versions without truncation, and trains exactly the queries' own length distribution on a
long tail, where APRIL-style release is measurably skewed short; sync keeps one batch in flight;
APRIL releases by completion; a resumed buffer continues as the uninterrupted one; the hint schedule
matches its formula (with the floor for never-solved queries) and pass rates count and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenloom.trainer.rl.buffer import (
    BUFFERS,
    AprilBuffer,
    Query,
    SyncBuffer,
    Trajectory,
    UnbiasedReplayBuffer,
    make_buffer,
    simulate,
)
from tokenloom.trainer.rl.hints import HintConfig, PassRates, hint_fraction, hint_tokens


def _record(buffer, index: int, member: int, n: int, finished: bool, version: int = 0) -> None:
    buffer.record((index, member), [7] * n, [-0.5] * n, version, finished)


def _keys(batch: list[Trajectory]) -> list[tuple[int, int]]:
    return [(t.query.index, t.member) for t in batch]


def _long_tail(seed: int, queries: int, group_size: int, budget: int) -> np.ndarray:
    """Lengths per (query, member): lognormal, median 12 tokens, clipped to [1, 20 * budget]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(12), 1.5, size=(queries, group_size))), 1, 20 * budget).astype(int)


# -- U-RB: order and completeness ---------------------------------------------------------------


def test_urb_holds_a_finished_later_batch_until_the_earlier_batch_finishes():
    buf = make_buffer("urb", batch_queries=2, group_size=2, oversample=2)
    assert isinstance(buf, UnbiasedReplayBuffer) and buf.capacity == 4 and buf.wants() == 4
    buf.admit([Query(i, [1, 2], {"i": i}) for i in range(4)])
    assert buf.wants() == 0
    _record(buf, 0, 0, 3, finished=False)  # query 0 is still generating
    _record(buf, 0, 1, 2, finished=True)
    for index in (1, 2, 3):
        for member in (0, 1):
            _record(buf, index, member, 2, finished=True)
    assert buf.ready() is None  # batch 1 (queries 2, 3) is complete but batch 0 is not
    assert _keys(buf.active()) == [(0, 0)] and buf.in_flight() == 4
    _record(buf, 0, 0, 4, finished=True, version=1)
    first, second = buf.ready(), buf.ready()
    assert _keys(first) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _keys(second) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert buf.ready() is None and buf.in_flight() == 0 and buf.wants() == 4
    q00 = first[0]
    assert q00.tokens == [7] * 7 and q00.versions == [0, 0, 0, 1, 1, 1, 1] and q00.rounds == 2
    assert q00.staleness(3) == 3 and first[1].staleness(3) == 3 and Trajectory(Query(9, [], {}), 0).staleness(5) == 0


# Hand-worked: batch_queries=1, group_size=1, oversample=2, budget=2; query 1 is 5 tokens long, the
# others 1. urb: round 1 (v0) ends q0 and gives q1 2 tokens -> batch [q0]; q2 joins; round 2 (v1)
# ends q2, q1 at 4; round 3 (v1) ends q1 -> [q1], then [q2]. april releases q2 as soon as it ends
# (v1), q3 joins, and q1's last token comes in round 3 at v2. sync starts q1 only after q0's
# release (v1) and q2 after q1's.
HAND = {
    "urb": ([[0], [1], [2]], [0, 0, 1, 1, 1], 3),
    "april": ([[0], [2], [1]], [0, 0, 1, 1, 2], 3),
    "sync": ([[0], [1], [2]], [1, 1, 1, 1, 1], 3),
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_worked_schedule_continues_responses_across_rounds_and_versions(name):
    batches = simulate(make_buffer(name, 1, 1, 2), lambda q, m: 5 if q == 1 else 1, budget=2, batches=3)
    order, versions, rounds = HAND[name]
    assert [[t.query.index for t in b] for b in batches] == order
    long = next(t for b in batches for t in b if t.query.index == 1)
    assert long.tokens == [0, 1, 2, 3, 4] and long.versions == versions and long.rounds == rounds
    assert long.finished and long.logprobs == [0.0] * 5


def test_urb_releases_consecutive_complete_queries_on_a_long_tail():
    bq, group, budget, k = 4, 3, 16, 12
    lengths = _long_tail(1, 200, group, budget)
    batches = simulate(make_buffer("urb", bq, group, 3), lambda q, m: int(lengths[q, m]), budget, k)
    assert len(batches) == k
    for b, batch in enumerate(batches):
        assert _keys(batch) == [(q, m) for q in range(b * bq, (b + 1) * bq) for m in range(group)]
        for t in batch:
            assert t.finished and len(t.tokens) == lengths[t.query.index, t.member] == len(t.versions)
            assert t.tokens == list(range(len(t.tokens)))  # continued in place, nothing dropped or repeated
            assert t.versions == sorted(t.versions) and max(t.versions, default=0) <= b
    trained = [t for batch in batches for t in batch]
    assert max(len(t.tokens) for t in trained) >= 10 * budget
    assert any(t.rounds >= 10 for t in trained)
    assert sum(len(set(t.versions)) > 1 for t in trained) >= 3  # some responses span several policies


def test_trained_lengths_follow_the_queries_for_urb_and_sync_and_skew_short_for_april():
    bq, group, oversample, budget, k = 8, 4, 8, 16, 10
    lengths = _long_tail(0, 2000, group, budget)
    own = lengths[: k * bq].ravel()
    assert (own >= 10 * budget).sum() >= 3  # the tail is there
    trained = {}
    for name in BUFFERS:
        batches = simulate(make_buffer(name, bq, group, oversample), lambda q, m: int(lengths[q, m]), budget, k)
        assert len(batches) == k and all(len(b) == bq * group for b in batches)
        trained[name] = np.array([len(t.tokens) for b in batches for t in b])
    assert sorted(trained["urb"].tolist()) == sorted(own.tolist())
    assert sorted(trained["sync"].tolist()) == sorted(own.tolist())
    assert trained["april"].mean() <= 0.8 * own.mean()


# -- sync and april -----------------------------------------------------------------------------


def test_sync_keeps_one_batch_in_flight():
    bq, group, budget = 3, 2, 4
    lengths = _long_tail(2, 100, group, budget)
    buf = make_buffer("sync", bq, group, oversample=5)
    assert isinstance(buf, SyncBuffer) and buf.capacity == bq
    held = []

    def length(q: int, m: int) -> int:
        held.append(buf.in_flight())
        return int(lengths[q, m])

    batches = simulate(buf, length, budget, 8)
    assert max(held) == bq
    for b, batch in enumerate(batches):  # started after batch b - 1 was released, so every token is version b
        assert all(set(t.versions) <= {b} for t in batch)
    buf.admit([Query(100, [], {})])
    assert buf.wants() == 0
    with pytest.raises(ValueError, match="admits 0 queries"):
        buf.admit([Query(101, [], {})])


def test_april_releases_groups_in_completion_order():
    buf = make_buffer("april", batch_queries=2, group_size=2, oversample=2)
    assert isinstance(buf, AprilBuffer)
    buf.admit([Query(i, [], {}) for i in range(4)])
    _record(buf, 0, 0, 2, finished=False)
    _record(buf, 0, 1, 2, finished=True)
    _record(buf, 3, 1, 1, finished=True)
    _record(buf, 3, 0, 1, finished=True)  # query 3 completes first
    _record(buf, 1, 0, 1, finished=True)
    _record(buf, 2, 0, 1, finished=True)
    assert buf.ready() is None  # only one complete group
    _record(buf, 1, 1, 1, finished=True)  # query 1 completes second
    resumed = make_buffer("april", batch_queries=2, group_size=2, oversample=2)
    resumed.load_state(json.loads(json.dumps(buf.to_state())))  # the completion order is part of the state
    assert _keys(resumed.ready()) == [(3, 0), (3, 1), (1, 0), (1, 1)]
    assert _keys(buf.ready()) == [(3, 0), (3, 1), (1, 0), (1, 1)]
    assert buf.wants() == 2
    buf.admit([Query(4, [], {}), Query(5, [], {})])
    _record(buf, 2, 1, 1, finished=True)
    _record(buf, 5, 0, 1, finished=True)
    _record(buf, 5, 1, 1, finished=True)
    assert _keys(buf.ready()) == [(2, 0), (2, 1), (5, 0), (5, 1)]
    assert _keys(buf.active()) == [(0, 0), (4, 0), (4, 1)]


# -- resume ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUFFERS))
def test_resumed_buffer_releases_what_the_uninterrupted_one_does(name):
    bq, group, oversample, budget = 2, 3, 3, 8
    lengths = _long_tail(3, 300, group, budget)

    def length(q: int, m: int) -> int:
        return int(lengths[q, m])

    def snapshot(batches):
        return [[(t.query.index, t.member, t.tokens, t.logprobs, t.versions, t.rounds) for t in b] for b in batches]

    whole = simulate(make_buffer(name, bq, group, oversample), length, budget, 12)
    first = make_buffer(name, bq, group, oversample)
    head = simulate(first, length, budget, 5)
    state = json.loads(json.dumps(first.to_state()))
    partial = [m for g in state["groups"] for m in g["members"] if m["tokens"] and not m["finished"]]
    if name == "sync":  # a released batch leaves the synchronous loop empty
        assert state["groups"] == []
    else:
        assert partial, "the cut should fall while responses are half generated"
    resumed = make_buffer(name, bq, group, oversample)
    resumed.load_state(state)
    assert resumed.in_flight() == first.in_flight() and _keys(resumed.active()) == _keys(first.active())
    tail = simulate(resumed, length, budget, 7)
    assert snapshot(head + tail) == snapshot(whole)
    assert all(t.staleness(12) >= 0 for b in tail for t in b)


def test_state_of_another_kind_or_size_is_refused():
    state = make_buffer("urb", 2, 2, 2).to_state()
    with pytest.raises(ValueError, match="same name and sizes"):
        make_buffer("april", 2, 2, 2).load_state(state)
    with pytest.raises(ValueError, match="same name and sizes"):
        make_buffer("urb", 2, 4, 2).load_state(state)


def test_trajectory_state_round_trips_through_json():
    traj = Trajectory(Query(5, [1, 2, 3], {"answer": " 9", "bucket": 1}, hint=[4]), 2, [10, 11], [-0.25, -1.5],
                      [3, 4], finished=True, rounds=2)
    assert Trajectory.from_state(json.loads(json.dumps(traj.to_state()))) == traj


# -- validation -------------------------------------------------------------------------------------


def test_bad_names_sizes_and_records_are_refused():
    with pytest.raises(ValueError, match="unknown replay buffer 'fifo'"):
        make_buffer("fifo", 2, 2, 2)
    for sizes in ((0, 2, 2), (2, 0, 2), (2, 2, 0), (-1, 2, 2)):
        with pytest.raises(ValueError, match="positive integer"):
            make_buffer("urb", *sizes)
    buf = make_buffer("urb", 1, 2, 2)
    with pytest.raises(ValueError, match="admits 2 queries"):
        buf.admit([Query(i, [], {}) for i in range(3)])
    buf.admit([Query(4, [], {})])
    with pytest.raises(ValueError, match="increasing index order"):
        buf.admit([Query(3, [], {})])
    with pytest.raises(ValueError, match="not in the buffer"):
        _record(buf, 0, 0, 1, finished=True)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        buf.record((4, 0), [1, 2], [0.0], 0, False)
    _record(buf, 4, 0, 1, finished=False, version=3)
    with pytest.raises(ValueError, match="older than its last"):
        _record(buf, 4, 0, 1, finished=False, version=2)
    _record(buf, 4, 0, 1, finished=True, version=3)
    with pytest.raises(ValueError, match="already finished"):
        _record(buf, 4, 0, 1, finished=True, version=3)


# -- hints ----------------------------------------------------------------------------------------


def test_hint_fraction_matches_the_formula_by_hand():
    cfg = HintConfig(p_init=0.8, gamma=0.1, hard_below=0.5, samples=8)
    assert hint_fraction(0, 0.25, cfg) == pytest.approx(0.8)
    assert hint_fraction(10, 0.25, cfg) == pytest.approx(0.623040626457124)  # 0.8 * exp(-0.1 * 10 * 0.25)
    assert hint_fraction(10, 0.1, cfg) == pytest.approx(0.7238699344287677)  # 0.8 * exp(-0.1 * 10 * 0.1)
    assert hint_fraction(10, 0.5, cfg) == 0.0 and hint_fraction(10, 0.9, cfg) == 0.0  # easy buckets
    # never solved: the floor 1 / (2 * 8) = 0.0625 makes it decay, 0.8 * exp(-0.1 * 10 * 0.0625)
    assert hint_fraction(10, 0.0, cfg) == pytest.approx(0.7515304502507807)
    assert hint_fraction(10, 0.03, cfg) == pytest.approx(0.7515304502507807)  # below the floor too
    seed_formula = HintConfig(p_init=0.8, gamma=0.1, samples=8, pass_floor=0.0)
    assert hint_fraction(1000, 0.0, seed_formula) == pytest.approx(0.8)  # the seed's: no decay at pass_init = 0
    assert hint_fraction(10, 0.0, HintConfig(p_init=0.8, gamma=0.1, pass_floor=0.2)) == pytest.approx(
        0.8 * np.exp(-0.2))
    with pytest.raises(ValueError, match="pass_init in"):
        hint_fraction(1, 1.5, cfg)


def test_hint_tokens_round_half_up_and_leave_the_last_token():
    ref = list(range(100, 110))
    assert hint_tokens(ref, 0.25) == [100, 101, 102]  # 2.5 -> 3
    assert hint_tokens(ref, 0.24) == [100, 101]  # 2.4 -> 2
    assert hint_tokens(ref, 0.0) == []
    assert hint_tokens(ref, 1.0) == ref[:9]  # never the whole answer
    assert hint_tokens([5], 1.0) == [] and hint_tokens([], 0.5) == []
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        hint_tokens(ref, 1.5)


@pytest.mark.parametrize("field, value", [("p_init", 1.5), ("gamma", -0.1), ("hard_below", 0.0), ("samples", 0),
                                          ("pass_floor", 2.0), ("pass_floor", "0.1")])
def test_hint_config_validate_names_the_bad_field(field, value):
    HintConfig().validate()
    with pytest.raises(ValueError, match=f"hint.{field}"):
        HintConfig(**{field: value}).validate()


def test_pass_rates_count_per_bucket_and_resume():
    rates = PassRates()
    assert not rates.to_state()["counts"]  # the loop measures pass_init only when nothing was counted
    for passed in (True, False, False, True):
        rates.record(0, passed)
    for _ in range(3):
        rates.record(2, False)
    assert rates.rate(0) == 0.5 and rates.rate(2) == 0.0
    with pytest.raises(ValueError, match="no pass-rate samples for bucket 1"):
        rates.rate(1)
    again = PassRates()
    again.load_state(json.loads(json.dumps(rates.to_state())))
    assert again.rate(0) == 0.5 and again.rate(2) == 0.0 and again.to_state() == rates.to_state()
    again.record(2, True)
    assert again.rate(2) == 0.25
    with pytest.raises(ValueError, match="3 passed of 2 seen"):
        PassRates().load_state({"counts": [[0, 3, 2]]})
