"""The store's shared rules (`trainingrun.store.common`), tested directly: pure functions, no store behind them. Both
backends call these (tests/integration/test_store*.py run the backends themselves against a temp dir and a real
redis-server), so a rule checked here is the rule of both."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainingrun.contract.errors import CorruptPayload, StoreError
from trainingrun.store import common
from trainingrun.store.base import RolloutReleased, StaleAttempt, StoreDataLost, WriterConflict
from trainingrun.store.common import Marker, Owner, WeightsMarker

URL = "redis://test:1/0"
attempts = st.none() | st.integers(0, 5)


def owner(attempt: int | None, token: str = "t", pid: int = 10) -> Owner:
    return Owner(token=token, attempt=attempt, host="node-1", pid=pid, pid_start=1, run="r", since=0.0)


def alive(_owner: Owner) -> bool:
    return False


def dead(_owner: Owner) -> bool:
    return True


def verdict(fn, *args, **kwargs) -> str:
    """What a rule decides, as a word: its return value, or the error type it raises."""
    try:
        return repr(fn(*args, **kwargs))
    except StaleAttempt:
        return "stale"
    except WriterConflict:
        return "conflict"


# ------------------------------------------------------------------------------------------------- the writer claim
NOBODY = "nobody"


@pytest.mark.parametrize("current, me, is_dead, expected", [
    (NOBODY, 0, False, "False"),  # nobody holds it: claim
    (2, 3, False, "False"),  # an older attempt's live writer: taken over
    (3, 3, False, "conflict"),  # the same attempt, alive
    (3, 3, True, "False"),  # the same attempt, dead: taken over
    (4, 3, True, "stale"),  # a newer attempt, even dead: this one is fenced off
    (None, 0, True, "False"),  # an unfenced owner counts as attempt 0
    (None, 0, False, "conflict"),
    (0, None, False, "conflict"),  # an unfenced claimant counts as attempt 0 too
    (3, None, False, "stale"),
    (None, 1, False, "False"),
])
def test_may_claim_table(current, me, is_dead, expected):
    holder = None if current == NOBODY else owner(current, "them", 7)
    assert verdict(common.may_claim, holder, owner(me, "me"), url=URL, dead=dead if is_dead else alive) == expected


def test_a_rollout_restarted_alone_takes_the_claim_from_its_predecessor_of_the_same_attempt():
    """A rollout restarted alone (TRAININGRUN_ROLE_ATTEMPT g+1, same attempt) takes over at once from generation g,
    even while g's lease lives (a pod on a lost node, a lease not yet expired); g is refused from then on: at its
    next write (it held the claim) and when it tries to claim again. Claims stored before generations existed read
    as generation 0."""
    old = Owner(token="old", attempt=3, host="node-1", pid=1, pid_start=1, run="r", since=0.0, generation=1)
    new = Owner(token="new", attempt=3, host="node-2", pid=2, pid_start=1, run="r", since=1.0, generation=2)
    assert verdict(common.may_claim, old, new, url=URL, dead=alive) == "False"
    assert verdict(common.check_writer, new, old, held=True, url=URL, op="publishing", dead=alive) == "conflict"
    assert verdict(common.may_claim, new, old, url=URL, dead=dead) == "conflict"
    # a newer attempt still wins over any generation of an older one, and fences it
    assert verdict(common.may_claim, new, owner(4, "next"), url=URL, dead=alive) == "False"
    assert verdict(common.may_claim, owner(4, "next"), new, url=URL, dead=alive) == "stale"
    assert "generation 2" in new.describe() and Owner.from_json(new.to_json(), where="w") == new
    legacy = {k: v for k, v in old.to_json().items() if k != "generation"}
    assert Owner.from_json(legacy, where="w").generation == 0


def test_the_writer_generation_comes_from_the_process_environment(monkeypatch):
    monkeypatch.setenv("TRAININGRUN_ROLE_ATTEMPT", "3")
    assert Owner.me(1).generation == 3
    monkeypatch.delenv("TRAININGRUN_ROLE_ATTEMPT")
    assert Owner.me(1).generation == 0


def test_may_claim_holder_and_error_contents():
    me = owner(2, "me")
    assert common.may_claim(me, me, url=URL, dead=alive) is True  # already ours (the lease is just refreshed)
    with pytest.raises(StaleAttempt) as info:
        common.may_claim(owner(5, "them"), me, url=URL, dead=dead)
    assert (info.value.attempt, info.value.current) == (2, 5) and "claiming the writer" in str(info.value)
    with pytest.raises(WriterConflict) as info:
        common.may_claim(owner(2, "them", pid=4711), me, url=URL, dead=alive)
    assert info.value.owner["token"] == "them" and "pid 4711 on node-1" in str(info.value)
    assert "already holds the store" in str(info.value) and URL in str(info.value)


@given(a=attempts, b=attempts, a_dead=st.booleans(), b_dead=st.booleans())
def test_of_two_claimants_the_newer_attempt_wins_whichever_claims_first(a, b, a_dead, b_dead):
    """Claimant A holds the claim, B asks (and the other way round): with different attempts the newer one ends up
    holding it and the older one is fenced off; with the same attempt the holder keeps it while it lives."""
    first, second = owner(a, "a"), owner(b, "b")
    liveness = {"a": a_dead, "b": b_dead}

    def is_dead(o: Owner) -> bool:
        return liveness[o.token]

    b_over_a = verdict(common.may_claim, first, second, url=URL, dead=is_dead)
    a_over_b = verdict(common.may_claim, second, first, url=URL, dead=is_dead)
    if (a or 0) != (b or 0):
        newer_asks, older_asks = (b_over_a, a_over_b) if (b or 0) > (a or 0) else (a_over_b, b_over_a)
        assert (newer_asks, older_asks) == ("False", "stale")
    else:
        assert b_over_a == ("False" if a_dead else "conflict")
        assert a_over_b == ("False" if b_dead else "conflict")


@given(current=st.none() | attempts.map(lambda a: owner(a, "them")), mine=attempts, is_dead=st.booleans())
def test_whoever_may_claim_then_passes_the_writer_check(current, mine, is_dead):
    """The claim decision and the check before a writer's operation agree: a claimant allowed to claim passes its
    next writer check once its claim is stored; one refused the claim by a live holder is refused the write too."""
    me = owner(mine, "me")
    claim = verdict(common.may_claim, current, me, url=URL, dead=lambda _o: is_dead)
    if claim in ("False", "True"):
        common.check_writer(me, me, held=True, url=URL, op="publishing", dead=lambda _o: is_dead)
    elif not is_dead:
        write = verdict(common.check_writer, current, me, held=False, url=URL, op="publishing", dead=alive)
        assert write in ("stale", "conflict")


@pytest.mark.parametrize("current, held, lost_to, is_dead, expected", [
    (None, False, None, False, "None"),  # nobody holds the claim: an unclaimed handle may write
    ("me", True, None, False, "None"),
    ("them", True, None, False, "conflict"),  # this writer lost its claim
    ("them", False, None, False, "conflict"),  # a live writer holds it
    ("them", False, None, True, "None"),  # its owner is dead
    ("newer", True, None, False, "stale"),
    ("newer", False, None, True, "stale"),
    ("me", True, "them", False, "conflict"),  # the lease thread saw another owner take it
    (None, True, "them", False, "conflict"),
])
def test_check_writer_table(current, held, lost_to, is_dead, expected):
    me = owner(2, "me")
    owners = {None: None, "me": me, "them": owner(2, "them"), "newer": owner(3, "newer")}
    got = verdict(common.check_writer, owners[current], me, held=held, url=URL, op="finishing the stream",
                  lost_to=owners[lost_to], dead=dead if is_dead else alive)
    assert got == expected


def test_check_writer_names_the_lost_claim():
    with pytest.raises(WriterConflict, match="this writer lost its claim on the store to another writer"):
        common.check_writer(owner(2, "them"), owner(2, "me"), held=True, url=URL, op="publishing", dead=dead)


@given(attempt=attempts, current=attempts)
def test_check_current_refuses_exactly_an_older_fenced_attempt(attempt, current):
    refused = attempt is not None and current is not None and current > attempt
    assert verdict(common.check_current, attempt, current, url=URL, op="acknowledging rollout 1") == (
        "stale" if refused else "None")


# ------------------------------------------------------------------------------------------------- the stream
def _never() -> int:
    raise AssertionError("read although the rollout is committed")


@given(rollout=st.integers(0, 50), released=st.integers(0, 50), finished=st.none() | st.integers(0, 50),
       committed=st.booleans())
def test_wait_verdict(rollout, released, finished, committed):
    def call() -> str:
        try:
            return repr(common.wait_verdict(rollout, committed=committed, released=_never if committed else
                                            lambda: released, finished=_never if committed else lambda: finished,
                                            url=URL))
        except RolloutReleased as exc:
            assert f"rollout {rollout} was released" in str(exc) and URL in str(exc)
            return "released"

    if committed:
        expected = "True"
    elif rollout < released:
        expected = "released"
    elif finished is not None and rollout >= finished:
        expected = "False"
    else:
        expected = "None"
    assert call() == expected


@given(rollout=st.integers(0, 20), released=st.integers(0, 20), committed=st.booleans())
def test_a_missing_part_is_released_or_lost(rollout, released, committed):
    err = common.part_missing(rollout, "key P:r:1:schedule", committed=committed, released=released, url=URL)
    if rollout < released or not committed:
        assert isinstance(err, RolloutReleased) and "released (deleted) while being read" in str(err)
    else:
        assert isinstance(err, StoreDataLost) and "is committed but key P:r:1:schedule is missing" in str(err)
    weights = common.weights_missing(3, "/w/3/a0/meta.json", committed=committed, url=URL)
    assert isinstance(weights, StoreDataLost) == committed
    assert isinstance(weights, StoreError)


def _marker(k: int, dp: int) -> Marker:
    return Marker(rollout=k, dp_size=dp, attempt=0, schedule_crc=0)


# committed rollouts ascending: (k, its marker naming dp ranks, or None: released meanwhile; ranks acked)
ledgers = st.lists(st.tuples(st.integers(0, 30), st.none() | st.integers(1, 4), st.integers(0, 5)), max_size=12,
                   unique_by=lambda t: t[0]).map(
    lambda rows: [(k, None if dp is None else _marker(k, dp), acks) for k, dp, acks in sorted(rows)])


@given(ledger=ledgers, rollout=st.integers(0, 32), released=st.integers(0, 32))
def test_release_plan_deletes_exactly_the_acked_and_keeps_the_mark_honest(ledger, rollout, released):
    delete, mark = common.release_plan(rollout, ledger, released)
    acked = [k for k, m, acks in ledger if k < rollout and m is not None and acks >= m.dp_size]
    assert delete == acked
    kept = [k for k, m, acks in ledger if k < rollout and k not in acked]
    upto = min([rollout, *kept])
    assert mark == (upto if upto > released else None)
    if mark is not None:  # below the mark every rollout is gone, never just some
        assert all(k in delete for k, _, _ in ledger if k < mark)


@given(ledger=ledgers)
def test_pending_count(ledger):
    assert common.pending_count(ledger) == sum(1 for _, m, acks in ledger if m is not None and acks < m.dp_size)


# ------------------------------------------------------------------------------------------------- stored values
def test_epoch_id():
    raw = b'{"id": "abc", "created": 1.0, "host": "h"}'
    assert common.epoch_id(None, None, url=URL, where="key P:epoch") is None  # a store not used yet
    assert common.epoch_id(raw, None, url=URL, where="key P:epoch") == "abc"
    assert common.epoch_id(raw, "abc", url=URL, where="key P:epoch") == "abc"
    with pytest.raises(StoreDataLost, match="lost its data: key P:epoch is gone .this process saw epoch abc"):
        common.epoch_id(None, "abc", url=URL, where="key P:epoch")
    with pytest.raises(StoreDataLost, match="its epoch changed from old to abc"):
        common.epoch_id(raw, "old", url=URL, where="key P:epoch")
    for bad in (b'{"id": 3}', b"[1]", b"NaN", b"\xff"):
        with pytest.raises(CorruptPayload, match="key P:epoch"):
            common.epoch_id(bad, None, url=URL, where="key P:epoch")


def test_committed_marker_and_its_document():
    schedule = b'{"rollout": 4, "dp_size": 2}'
    marker = Marker.for_schedule(4, 2, 1, schedule)
    raw = marker.encode()
    assert common.committed_marker(raw, 4, url=URL, where="key P:r:4:commit") == marker
    assert common.committed_json(marker, schedule, where="at") == {"rollout": 4, "dp_size": 2}
    with pytest.raises(StoreError, match=r"rollout 4 is not committed \(key P:r:4:commit\)"):
        common.committed_marker(None, 4, url=URL, where="key P:r:4:commit")
    with pytest.raises(CorruptPayload, match="commit marker names rollout 4"):
        common.committed_marker(raw, 5, url=URL, where="key P:r:5:commit")
    with pytest.raises(CorruptPayload, match="schedule fails the CRC-32"):
        common.committed_json(marker, schedule.replace(b"2", b"3"), where="at")
    with pytest.raises(StoreError, match=r"no payload for rank 2 \(dp_size 2\)"):
        common.payload_rank(marker, 2, url=URL)
    assert common.payload_rank(marker, 1, url=URL) == 1
    meta = b'{"v": 1}'
    weights = WeightsMarker.for_meta(7, None, 100, 1, meta)
    assert common.committed_weights(weights.encode(), 7, url=URL, where="w", chunks=1) == weights
    assert common.committed_json(weights, meta, where="m") == {"v": 1}
    with pytest.raises(CorruptPayload, match="weight meta fails the CRC-32"):
        common.committed_json(weights, b'{"v": 2}', where="m")
    with pytest.raises(CorruptPayload, match="names version 7 in 1 pieces"):
        common.committed_weights(weights.encode(), 7, url=URL, where="w", chunks=2)
    common.check_weights_size(100, weights, where="w")
    with pytest.raises(CorruptPayload, match="w: 101 bytes stored, but its commit marker records 100"):
        common.check_weights_size(101, weights, where="w")


@given(value=st.one_of(st.integers(-5, 2**64), st.floats(allow_nan=True), st.text(max_size=5), st.booleans(),
                       st.dictionaries(st.sampled_from(["upto", "x"]), st.integers(-3, 10), max_size=2)))
def test_stored_count_takes_only_a_plain_non_negative_integer(value):
    inner = value.get("upto") if isinstance(value, dict) else value
    ok = isinstance(inner, int) and not isinstance(inner, bool) and 0 <= inner <= 2**63 - 1
    try:
        assert common.stored_count(value, where="RELEASED", field="upto") == inner and ok
    except CorruptPayload as exc:
        assert not ok and "RELEASED: upto must be an integer" in str(exc)
