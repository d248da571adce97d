"""The daemon's state database: the lease (taken atomically, renewed, released, taken over after
its holder dies), the run log and the append-only promotion history."""

import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.lease import Lease, LeaseHeld
from specloop.daemon.retrain.run_log import RunLog, RunOutcome
from specloop.daemon.retrain.state_db import open_state


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'state' / 'state.db'}"


def test_one_holder_at_a_time_and_release_frees_it(url: str) -> None:
    db = open_state(url)
    a, b = Lease(db, "train:x", "a", ttl_s=30), Lease(db, "train:x", "b", ttl_s=30)
    with a:
        assert not b.try_acquire()
        with pytest.raises(LeaseHeld, match="held by a"):
            b.__enter__()
        assert Lease(db, "train:y", "b").try_acquire()  # another base model is another lease
    with b:
        assert b.holder()[0] == "b"


def test_a_dead_holders_lease_expires_and_is_taken_over(url: str) -> None:
    db = open_state(url)
    dead = Lease(db, "train:x", "dead", ttl_s=0.5)
    assert dead.try_acquire()  # taken, never renewed: its holder was SIGKILLed
    other = Lease(open_state(url), "train:x", "other", ttl_s=30)
    assert not other.try_acquire()
    time.sleep(0.6)
    assert other.try_acquire() and other.holder()[0] == "other"


def test_the_holder_renews_while_it_works(url: str) -> None:
    db = open_state(url)
    with Lease(db, "train:x", "a", ttl_s=0.6) as held:
        time.sleep(1.5)  # past two ttls: only renewal keeps it
        assert not Lease(db, "train:x", "b").try_acquire() and not held.lost


def test_concurrent_takers_get_it_once(url: str) -> None:
    db = open_state(url)
    won: list[str] = []
    answered: list[str] = []
    barrier = threading.Barrier(6)

    def take(name: str) -> None:
        lease = Lease(db, "train:x", name, ttl_s=30)  # six creators of a new database's tables at once
        barrier.wait()
        if lease.try_acquire():
            won.append(name)
        answered.append(name)

    threads = [threading.Thread(target=take, args=(f"d{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answered) == 6 and len(won) == 1


def test_history_appends_and_reads_back_in_order_across_opens(url: str) -> None:
    history = PromotionHistory(open_state(url))
    history.record("fp", Action.PROMOTED, "v2", "gate passed", previous="v1", run_id="r1")
    history.record("fp", Action.ROLLED_BACK, "v2", "live τ fell", previous="v1")
    history.record("other", Action.REFUSED, "v1", "worse")
    again = PromotionHistory(open_state(url))
    assert [(e.action, e.version) for e in again.events("fp")] == [(Action.PROMOTED, "v2"), (Action.ROLLED_BACK, "v2")]
    assert again.last("fp", Action.PROMOTED).run_id == "r1" and again.events("fp")[0].at.tzinfo is UTC
    assert [e.base_model for e in again.events(limit=1)] == ["other"]
    assert not hasattr(again, "delete") and not hasattr(again, "update")


def test_run_log_steps_finish_and_abandon(url: str) -> None:
    runs = RunLog(open_state(url))
    now = datetime.now(UTC)
    runs.start("r1", "fp", now)
    runs.step("r1", "train", {"dataset": 1.5})
    runs.finish("r1", RunOutcome.REFUSED, "worse", {"dataset": 1.5, "train": 60.0})
    runs.start("r2", "fp", now)
    runs.step("r2", "evaluate", {"dataset": 1.0})
    assert runs.last_trained("fp").run_id == "r1" and runs.last_trained("fp").data_until == now
    (abandoned,) = runs.abandon_unfinished("fp", "daemon died")
    assert abandoned.run_id == "r2"
    record = runs.runs("fp")[-1]
    assert record.outcome is RunOutcome.ABANDONED and record.detail == "daemon died (it was at step evaluate)"
    assert runs.last_trained("fp").run_id == "r1"


def test_a_memory_database_is_refused() -> None:
    with pytest.raises(ValueError, match="give a SQLite file"):
        open_state("sqlite://")
