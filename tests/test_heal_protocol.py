"""The generation protocol of healing in place (slipstream.resilience.heal), on a real TCPStore.

The process-group creation is replaced by a record of the generation each rank formed, so
several "processes" (threads) can run the protocol in one test: what is checked is that
survivors and replacements always meet in one generation, whoever comes first.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from slipstream.errors import TrainingFailed
from slipstream.resilience import heal


class RecordingHealer(heal.Healer):
    """A healer whose group is a note of the generation (no torch group: threads share one process)."""

    formed: dict[int, list[int]]

    def _init_group(self, generation: int) -> None:
        self.formed.setdefault(generation, []).append(self.rank)

    def _init_fake_group(self) -> None:
        pass

    def _drop_fake_group(self, collect: bool) -> None:
        pass

    def leave(self) -> None:
        if not self.pending:
            self._left, self.generation = self.generation, None


def make(store, rank, world, formed, replacement=False, timeout_s=20.0, collective_timeout_s=30.0) -> RecordingHealer:
    h = RecordingHealer(store, "t", rank, world, "gloo", datetime.timedelta(seconds=collective_timeout_s),
                        replacement=replacement, join_timeout_s=timeout_s)
    h.formed = formed
    return h


@pytest.fixture()
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def rejoin_all(healers) -> list[BaseException]:
    errors: list[BaseException] = []

    def go(h):
        try:
            h.rejoin()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(h,)) for h in healers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def form_all(healers) -> None:
    threads = [threading.Thread(target=h.form) for h in healers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


@pytest.mark.parametrize("replacement_first", [True, False])
def test_survivors_and_a_replacement_meet_in_the_next_generation(store, replacement_first):
    formed: dict[int, list[int]] = {}
    first = [make(store, r, 3, formed) for r in range(3)]
    form_all(first)
    assert sorted(formed[0]) == [0, 1, 2]
    survivors = [first[0], first[2]]
    replacement = make(store, 1, 3, formed, replacement=True)
    replacement.form()  # the fake group: no generation yet
    assert replacement.pending
    order = [replacement, *survivors] if replacement_first else [*survivors, replacement]
    assert rejoin_all(order) == []
    assert sorted(formed[1]) == [0, 1, 2]
    assert {h.generation for h in [*survivors, replacement]} == {1}
    assert [h.heals for h in survivors] == [1, 1] and replacement.heals == 0


def test_a_second_death_while_forming_moves_everyone_on(store):
    formed: dict[int, list[int]] = {}
    first = [make(store, r, 3, formed) for r in range(3)]
    form_all(first)
    # Rank 2 dies; rank 1 dies too before generation 1 forms: rank 0 and the two replacements
    # must end in one generation that all three formed.
    store.add("t/gen", 0)
    assert int(store.compare_set("t/gen", "0", "1")) == 1  # the first survivor's move
    store.add("t/1/joined", 1)  # rank 1 counted itself into generation 1, then died
    store.add("t/1/formed", 0)
    r1 = make(store, 1, 3, formed, replacement=True)
    r2 = make(store, 2, 3, formed, replacement=True)
    r1.form(), r2.form()
    # generation 1 can still form (rank 1's stale count plus two): who joins first decides nothing
    errors = rejoin_all([first[0], r1, r2])
    assert errors == []
    gens = {first[0].generation, r1.generation, r2.generation}
    assert len(gens) == 1
    (gen,) = gens
    assert sorted(formed[gen]) == [0, 1, 2]


def test_a_peer_that_never_comes_back_fails_in_time(store):
    formed: dict[int, list[int]] = {}
    first = [make(store, r, 2, formed, timeout_s=0.5) for r in range(2)]
    form_all(first)
    with pytest.raises(TrainingFailed) as failed:
        first[0].rejoin()
    # Which rank did not come, and where it was last seen.
    message = str(failed.value)
    assert "generation 1 did not form: nothing moved for 0 s (1 of 2 joined; rank 1 last said 'joined generation 0'" \
        in message, message


def test_a_slow_but_progressing_join_is_not_a_failure(store):
    # Three ranks that arrive 0.4 s apart, against a 0.5 s timeout: 0.8 s in all, but each
    # arrival is progress, so the group forms.
    formed: dict[int, list[int]] = {}
    first = [make(store, r, 3, formed) for r in range(3)]
    form_all(first)
    for h in first:
        h.join_timeout_s = 0.5
    errors: list[BaseException] = []

    def rejoin(h):
        try:
            h.rejoin()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    timers = [threading.Timer(0.4 * i, rejoin, args=(h,)) for i, h in enumerate(first)]
    for t in timers:
        t.start()
    for t in timers:
        t.join(timeout=30)
    assert errors == [] and sorted(formed[1]) == [0, 1, 2], errors


def test_a_replacement_that_never_reaches_accelerate_is_named(store):
    formed: dict[int, list[int]] = {}
    first = [make(store, r, 2, formed, timeout_s=0.3) for r in range(2)]
    form_all(first)
    make(store, 1, 2, formed, replacement=True).form()  # started, still in the script
    with pytest.raises(TrainingFailed, match="rank 1 last said 'a replacement, running the script up to accelerate"):
        first[0].rejoin()


def test_a_rank_that_hangs_in_the_failed_generation_is_evicted(store):
    # Rank 1 is SIGSTOPped: it never fails its collective, never leaves generation 0. One
    # collective timeout after rank 0 began forming generation 1, rank 0 asks rank 1's
    # supervisor (through the store) to kill the process rank 1 recorded, once.
    formed: dict[int, list[int]] = {}
    first = [make(store, r, 2, formed, timeout_s=1.0, collective_timeout_s=0.2) for r in range(2)]
    form_all(first)
    with pytest.raises(TrainingFailed):  # nothing replaces it here: the join still times out
        first[0].rejoin()
    assert store.get("t/rank1/evict").decode() == str(os.getpid())


def test_a_rank_that_left_or_is_replaced_is_not_evicted(store):
    formed: dict[int, list[int]] = {}
    first = [make(store, r, 3, formed, timeout_s=1.0, collective_timeout_s=0.2) for r in range(3)]
    form_all(first)
    first[1]._note("left generation 0")  # failed its collective too, on its way to the protocol
    make(store, 2, 3, formed, replacement=True).form()  # a replacement still in the script
    with pytest.raises(TrainingFailed):
        first[0].rejoin()
    assert not store.check(["t/rank1/evict"]) and not store.check(["t/rank2/evict"])


def test_the_spare_kills_its_supervisors_hung_child_and_nothing_else(store, monkeypatch, capsys):
    # This test process plays the supervisor: the watcher kills a pid only when its parent is the
    # spare's parent (a pid from the store may be another node's).
    monkeypatch.setattr(heal.os, "getppid", os.getpid)
    host, port = "127.0.0.1", store.port
    env = {heal.heal_env.STORE: f"{host}:{port}", "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    stranger = subprocess.Popen([sys.executable, "-c", "import os, signal, subprocess, sys; "
                                 "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                                 "print(p.pid, flush=True); p.wait()"], stdout=subprocess.PIPE, text=True)
    grandchild = int(stranger.stdout.readline())  # not the supervisor's child
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stop = threading.Event()
    try:
        watcher = heal.watch_for_eviction(env, stop)
        assert watcher is not None
        store.set("slipstream/heal/attempt0/rank1/evict", str(grandchild))
        store.set("slipstream/heal/attempt0/rank0/evict", str(hung.pid))  # another rank's: not this spare's
        deadline = 50
        while store.check(["slipstream/heal/attempt0/rank1/evict"]) and deadline:  # consumed, not acted on
            stop.wait(0.1)
            deadline -= 1
        assert stranger.poll() is None and hung.poll() is None
        store.set("slipstream/heal/attempt0/rank1/evict", str(hung.pid))
        assert hung.wait(timeout=10) == -9
        assert f"rank 1: the training process (pid {hung.pid}) hangs" in capsys.readouterr().err
    finally:
        stop.set()
        for proc in (hung, stranger):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        try:
            os.kill(grandchild, 9)
        except ProcessLookupError:
            pass


def test_healing_is_passed_in_not_read_from_a_global():
    """Issue #43 item 4: the healer reaches the training side through the runtime (``Runtime.healer``,
    which ``accelerate()`` hands on), and whether a side group may be made on gloo is asked of the
    default group itself (``heal.on_fake_group``): no module of the library keeps or reads a
    process-wide healer."""
    import ast
    from pathlib import Path

    import slipstream
    from slipstream.process.runtime import Runtime

    assert "healer" in Runtime.__dataclass_fields__
    assert not hasattr(heal, "current") and not hasattr(heal, "_CURRENT")
    src = Path(slipstream.__file__).parent
    readers = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global) or (isinstance(node, ast.Attribute) and node.attr == "current"
                                                and isinstance(node.value, ast.Name) and node.value.id == "heal"):
                if path.name == "heal.py" or not isinstance(node, ast.Global):
                    readers.append(f"{path.relative_to(src)}:{node.lineno}")
    assert readers == [], readers


def test_the_fake_default_group_is_told_by_the_group_itself():
    assert not heal.on_fake_group() and heal.side_group_backend() == "gloo"  # no group at all
    heal._register_fake_backend()
    dist.init_process_group(heal._FAKE_BACKEND, store=dist.HashStore(), rank=0, world_size=2)
    try:
        assert heal.on_fake_group() and heal.side_group_backend() is None
    finally:
        dist.destroy_process_group()
    assert not heal.on_fake_group()
