"""Hang watchdog without a process group: cost of beat, the "who did not arrive" rules,
the message, the stack dump, the flight recorder settings, and the whole protocol run
by in-process watchdogs that share a HashStore (exit_on_hang=False keeps pytest alive).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from scaletrain.dist import Topology
from scaletrain.errors import ConfigError
from scaletrain.observe import (
    EXIT_HANG,
    HangDiagnosis,
    Heartbeat,
    Watchdog,
    WatchdogConfig,
    configure_flight_recorder,
    dump_stacks,
    find_laggards,
    format_hang_message,
)
from scaletrain.observe.hang.diagnosis import _ranks_str
from scaletrain.observe.hang.stacks import _locate

pytestmark = pytest.mark.timeout(60)


def hb(rank: int, step: int, **kw: object) -> Heartbeat:
    return Heartbeat(rank=rank, step=step, **kw)  # type: ignore[arg-type]


# -- beat is cheap ----------------------------------------------------------------------


def test_beat_costs_microseconds_even_with_the_thread_running() -> None:
    wd = Watchdog(Topology(), timeout_s=60, run_dir="/nonexistent").start()
    try:
        t0 = time.perf_counter()
        for i in range(100_000):
            wd.beat(i, "forward")
        elapsed = time.perf_counter() - t0
    finally:
        wd.stop()
    # Measured ~0.03 s here; the bound leaves room for a loaded 2-core machine.
    assert elapsed < 0.5, f"100k beats took {elapsed:.3f} s"
    assert wd._beat[:2] == (99_999, "forward")


# -- find_laggards: the rules -----------------------------------------------------------


def test_rank_behind_by_a_step_did_not_arrive() -> None:
    beats = {0: hb(0, 7), 1: hb(1, 6, phase="forward"), 2: hb(2, 7), 3: hb(3, 7)}
    d = find_laggards(beats, 4)
    assert d.laggards == (1,) and d.waiting == (0, 2, 3) and d.step == 7
    assert "behind" in d.rule


def test_several_ranks_behind_by_different_amounts() -> None:
    beats = {0: hb(0, 9), 1: hb(1, 3), 2: hb(2, 8), 3: hb(3, 9)}
    d = find_laggards(beats, 4)
    assert d.laggards == (1, 2) and d.waiting == (0, 3)


def test_same_step_fewer_collectives_did_not_arrive() -> None:
    # Both beat at the start of step 5; rank 1 never reached the all_reduce.
    beats = {
        0: hb(0, 5, seq=6, collective="all_reduce"),
        1: hb(1, 5, seq=5, collective=""),
    }
    d = find_laggards(beats, 2)
    assert d.laggards == (1,) and d.waiting == (0,)
    assert "fewer collectives" in d.rule


def test_sequence_numbers_win_over_the_stack_heuristic() -> None:
    # DDP's all-reduce runs inside backward: the waiting rank is not "inside
    # torch.distributed" by its Python stack, but it issued more collectives.
    beats = {0: hb(0, 5, seq=12, collective=""), 1: hb(1, 5, seq=11, collective="")}
    assert find_laggards(beats, 2).laggards == (1,)


def test_same_step_same_count_outside_a_collective_did_not_arrive() -> None:
    beats = {
        0: hb(0, 5, seq=6, collective="barrier"),
        1: hb(1, 5, seq=6, collective=""),
        2: hb(2, 5, seq=6, collective="barrier"),
    }
    d = find_laggards(beats, 3)
    assert d.laggards == (1,) and d.waiting == (0, 2)
    assert "outside torch.distributed" in d.rule


def test_unknown_sequence_numbers_fall_back_to_the_stacks() -> None:
    beats = {0: hb(0, 5, seq=None, collective="all_reduce"), 1: hb(1, 5, seq=3, collective="")}
    assert find_laggards(beats, 2).laggards == (1,)


def test_everyone_inside_a_collective_names_no_one() -> None:
    beats = {r: hb(r, 5, seq=6, collective="all_reduce") for r in range(4)}
    d = find_laggards(beats, 4)
    assert d.laggards == () and d.waiting == (0, 1, 2, 3)


def test_nothing_known_but_the_step_names_no_one() -> None:
    beats = {r: hb(r, 5) for r in range(3)}
    d = find_laggards(beats, 3)
    assert d.laggards == () and d.waiting == (0, 1, 2) and d.rule == ""


def test_rank_without_heartbeat_is_missing() -> None:
    beats = {0: hb(0, 4), 2: hb(2, 4)}
    d = find_laggards(beats, 3)
    assert d.missing == (1,) and d.laggards == (1,) and d.waiting == (0, 2)


def test_rank_that_did_not_answer_is_unresponsive() -> None:
    beats = {r: hb(r, 4, seq=9, collective="all_reduce") for r in range(4)}
    d = find_laggards(beats, 4, responsive={0, 1, 3})
    assert d.unresponsive == (2,) and d.laggards == (2,) and d.waiting == (0, 1, 3)
    # Its stale heartbeat does not count towards the step of the others.
    beats[2] = hb(2, 99)
    assert find_laggards(beats, 4, responsive={0, 1, 3}).step == 4


def test_rank_that_finished_is_named() -> None:
    beats = {0: hb(0, 10, stopped=True), 1: hb(1, 11, collective="all_reduce")}
    d = find_laggards(beats, 2)
    assert d.finished == (0,) and d.laggards == (0,) and d.waiting == (1,)


def test_rank_stuck_before_its_first_beat() -> None:
    beats = {0: hb(0, 0), 1: hb(1, -1, phase="start")}
    assert find_laggards(beats, 2).laggards == (1,)


def test_world_size_one_names_no_one() -> None:
    d = find_laggards({0: hb(0, 3)}, 1)
    assert d.laggards == () and d.waiting == (0,) and d.step == 3


def test_nobody_live() -> None:
    d = find_laggards({0: hb(0, 3)}, 2, responsive=set())
    assert d.laggards == (0, 1) and d.waiting == () and d.missing == (1,)


def test_many_ranks_mixed_rules() -> None:
    beats = {r: hb(r, 20, seq=40, collective="all_reduce") for r in range(64)}
    beats[5] = hb(5, 19)
    del beats[17]
    d = find_laggards(beats, 64, responsive=set(range(64)) - {33})
    assert d.laggards == (5, 17, 33)
    assert d.missing == (17,) and d.unresponsive == (33,)
    assert len(d.waiting) == 61


def test_bad_world_size() -> None:
    with pytest.raises(ConfigError, match="world_size=0"):
        find_laggards({}, 0)


def test_ranks_str_compresses_ranges() -> None:
    assert _ranks_str([]) == "[]"
    assert _ranks_str([1]) == "[1]"
    assert _ranks_str([5, 0, 1, 2, 7, 8]) == "[0-2, 5, 7-8]"


# -- the message --------------------------------------------------------------------


def test_message_names_the_late_rank_where_it_was_and_the_fix(tmp_path: Path) -> None:
    beats = {
        0: hb(0, 7, phase="forward", idle_s=65.2, where="train.py:40 in main",
              collective="all_reduce", seq=14),
        1: hb(1, 6, phase="forward", idle_s=65.0, where="train.py:31 in load", seq=13),
    }  # fmt: skip
    d = find_laggards(beats, 2)
    msg = format_hang_message(d, beats, timeout_s=60, hang_dir=tmp_path / "hang")
    assert msg.startswith("scaletrain: hang detected after 60 s")
    assert "rank(s) [1] did not arrive at step 7" in msg
    assert "last seen at step 6, phase 'forward', 65 s ago, at train.py:31 in load" in msg
    assert "rank(s) [0] waited in step 7" in msg and "inside all_reduce" in msg
    assert str(tmp_path / "hang" / "rank*.txt") in msg
    assert "Fix:" in msg and "--hang-timeout" in msg and str(EXIT_HANG) in msg
    assert "\n" not in msg  # one paragraph


def test_message_when_no_rank_can_be_named(tmp_path: Path) -> None:
    beats = {r: hb(r, 5, collective="all_reduce") for r in range(2)}
    msg = format_hang_message(find_laggards(beats, 2), beats, timeout_s=5, hang_dir=tmp_path)
    assert "every rank [0-1] is stalled at step 5" in msg
    assert "all wait inside a collective" in msg


def test_message_for_a_single_rank_and_the_recorder_hint(tmp_path: Path) -> None:
    beats = {0: hb(0, 2, phase="data", idle_s=9)}
    d = HangDiagnosis(step=2, laggards=(), waiting=(0,))
    msg = format_hang_message(d, beats, timeout_s=5, hang_dir=tmp_path, flight_recorder_hint=True)
    assert "rank 0 made no progress (last seen at step 2, phase 'data'" in msg
    assert "configure_flight_recorder" in msg


def test_message_lists_a_few_laggards_and_counts_the_rest(tmp_path: Path) -> None:
    beats = {r: hb(r, 3 if r < 10 else 4) for r in range(16)}
    msg = format_hang_message(find_laggards(beats, 16), beats, timeout_s=5, hang_dir=tmp_path)
    assert "rank(s) [0-9] did not arrive at step 4" in msg
    assert "and 6 more" in msg and "rank 4:" not in msg


def test_message_for_missing_unresponsive_and_finished(tmp_path: Path) -> None:
    beats = {0: hb(0, 5, collective="all_reduce"), 1: hb(1, 5), 3: hb(3, 2, stopped=True)}
    d = find_laggards(beats, 4, responsive={0})
    msg = format_hang_message(
        d, beats, timeout_s=5, hang_dir=tmp_path, traces=["/r/flight_recorder/"], nccl_trace=True
    )
    assert "rank(s) [1-3] did not arrive" in msg
    assert "rank 2: never sent a heartbeat" in msg
    assert "did not answer since" in msg and "it had stopped its watchdog" in msg
    assert "/r/flight_recorder/" in msg and "fr_trace" in msg


# -- stacks -------------------------------------------------------------------------


def test_dump_stacks_writes_every_thread_with_this_function(tmp_path: Path) -> None:
    release = threading.Event()
    parked = threading.Thread(target=release.wait, name="parked-helper", daemon=True)
    parked.start()
    try:
        path = tmp_path / "deep" / "rank0.txt"
        text = dump_stacks(path, header="HEADER LINE")
    finally:
        release.set()
        parked.join()
    assert path.read_text() == text
    assert text.startswith("HEADER LINE")
    assert "test_dump_stacks_writes_every_thread_with_this_function" in text
    assert "'parked-helper'" in text and "release.wait" not in text.split("'parked-helper'")[0]
    # The watched (main) thread comes first and is marked.
    assert text.index("the training thread") < text.index("'parked-helper'")


def test_locate_names_the_user_frame() -> None:
    import sys

    where, collective = _locate(sys._getframe())
    assert (
        where.startswith("test_watchdog_unit.py:") and "test_locate_names_the_user_frame" in where
    )
    assert collective == ""
    assert _locate(None) == ("", "")


# -- configuration ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, "timeout_s=0 must be positive"),
        ({"timeout_s": -3.0}, "timeout_s=-3.0"),
        ({"timeout_s": float("nan")}, "not a number"),
        ({"timeout_s": "10"}, "not a number"),
        ({"timeout_s": 5, "poll_s": 6}, r"poll_s=6 must be in \(0, timeout_s=5\]"),
        ({"timeout_s": 5, "poll_s": 0}, "poll_s=0"),
        ({"timeout_s": 5, "poll_s": 1, "grace_s": 0.5}, "grace_s=0.5 must be >= poll_s=1"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WatchdogConfig(**kwargs)  # type: ignore[arg-type]


def test_config_defaults_scale_with_the_timeout() -> None:
    assert WatchdogConfig().timeout_s == 300 and WatchdogConfig().poll_s == 5.0
    small = WatchdogConfig(timeout_s=3)
    assert small.poll_s == pytest.approx(0.3) and small.grace_s == 2.0
    assert WatchdogConfig(timeout_s=0.2).poll_s == 0.05


def test_the_watchdog_takes_its_rank_from_the_topology_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: without a Runtime the watchdog read RANK / WORLD_SIZE from the
    environment. Now the Topology (rank 1 of 2 here, where the environment says rank 0
    of 1) is its one source: its heartbeat is published as rank 1's, and a watchdog
    with no Topology is not built at all (the environment would have made it rank 3)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    wd = Watchdog(
        topology=Topology(rank=1, world_size=2),
        timeout_s=5,
        run_dir=tmp_path,
        store=store,
        exit_on_hang=False,
    )
    assert (wd.rank, wd.world_size) == (1, 2)
    assert wd.hang_dir == tmp_path / "hang"
    with wd:
        wd.beat(4, "forward")
        time.sleep(3 * (wd.config.poll_s or 0.5))  # the thread publishes at least once
    final = Heartbeat.from_json(store.get("scaletrain/watchdog/attempt0/hb/1"))
    assert final.rank == 1 and final.step == 4 and final.stopped
    assert not store.check(["scaletrain/watchdog/attempt0/hb/0"])
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(TypeError, match="topology"):
        Watchdog(run_dir=tmp_path)  # type: ignore[call-arg]


def test_a_runtime_given_for_the_topology_is_refused_with_the_fix() -> None:
    class Runtime:  # what st.init returns: it has .rank, and its Topology
        rank, world_size, topology = 1, 2, Topology(rank=1, world_size=2)

    with pytest.raises(ConfigError, match=r"Watchdog\(Runtime\).*pass rt.topology instead"):
        Watchdog(Runtime())  # type: ignore[arg-type]


def test_configure_flight_recorder_sets_env_once_and_respects_the_user(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    done = configure_flight_recorder(tmp_path, buffer_size=500, environ=env)
    assert env == done
    assert env["TORCH_FR_BUFFER_SIZE"] == "500"  # torch 2.13 reads the new names
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path / 'flight_recorder'}/rank_"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # deprecated in 2.13: no warning
    assert (tmp_path / "flight_recorder").is_dir()
    # A user's own setting, under the old name too, wins.
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    done = configure_flight_recorder(tmp_path, environ=env)
    assert "TORCH_FR_BUFFER_SIZE" not in env and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0"
    assert set(done) == {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"}
    with pytest.raises(ConfigError, match="buffer_size=0"):
        configure_flight_recorder(tmp_path, buffer_size=0, environ={})


def test_heartbeat_json_round_trip_ignores_unknown_fields() -> None:
    beat = hb(3, 7, phase="eval", idle_s=1.5, seq=4, collective="", where="x.py:1 in f")
    assert Heartbeat.from_json(beat.to_json()) == beat
    assert Heartbeat.from_json('{"rank": 1, "step": 2, "future_field": 1}') == hb(1, 2)


# -- the watchdog thread, in process ------------------------------------------------


def test_healthy_loop_never_fires_and_the_thread_stops(tmp_path: Path) -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))  # a missing key fails the test, not hangs it
    with Watchdog(
        Topology(), timeout_s=0.3, run_dir=tmp_path, store=store, exit_on_hang=False
    ) as wd:
        assert wd.running
        for step in range(40):  # 0.8 s: more than twice the timeout
            wd.beat(step)
            time.sleep(0.02)
    assert not wd.running and wd.report is None
    assert not (tmp_path / "hang").exists()
    final = Heartbeat.from_json(store.get("scaletrain/watchdog/attempt0/hb/0"))
    assert store.num_keys() == 1
    assert final.stopped and final.step == 39
    assert not any(t.name == "scaletrain-watchdog" for t in threading.enumerate())


def test_world_size_one_without_store_dumps_and_reports(tmp_path: Path) -> None:
    wd = Watchdog(Topology(), timeout_s=0.3, run_dir=tmp_path, exit_on_hang=False)
    wd.start()
    wd.beat(3, "data")
    deadline = time.monotonic() + 10
    while wd.report is None and time.monotonic() < deadline:
        time.sleep(0.05)  # this test function is "the stuck step"
    wd.stop()
    report = wd.report
    assert report is not None and report.reporter
    assert "rank 0 made no progress (last seen at step 3, phase 'data'" in report.message
    stacks = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "test_world_size_one_without_store_dumps_and_reports" in stacks
    assert (tmp_path / "hang" / "report.txt").read_text().strip() == report.message


def test_two_watchdogs_sharing_a_store_name_the_rank_behind(tmp_path: Path) -> None:
    """The whole protocol (election, dump request, acks, report) in one process."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    dogs = [
        Watchdog(
            Topology(rank=r, world_size=2),
            timeout_s=0.5,
            poll_s=0.05,
            run_dir=tmp_path,
            store=store,
            exit_on_hang=False,
        ).start()
        for r in range(2)
    ]
    dogs[0].beat(7, "forward")  # rank 0 reached step 7 and waits there
    dogs[1].beat(6, "backward")  # rank 1 is stuck in step 6
    deadline = time.monotonic() + 20
    while any(d.running for d in dogs) and time.monotonic() < deadline:
        time.sleep(0.05)
    reports = [d.report for d in dogs]
    assert all(r is not None for r in reports)
    leaders = [r for r in reports if r is not None and r.reporter]
    assert len(leaders) == 1  # exactly one paragraph
    (report,) = leaders
    assert report.diagnosis.laggards == (1,) and report.diagnosis.waiting == (0,)
    assert "rank(s) [1] did not arrive at step 7" in report.message
    assert "last seen at step 6, phase 'backward'" in report.message
    for r in range(2):
        text = (tmp_path / "hang" / f"rank{r}.txt").read_text()
        assert f"rank {r} of 2" in text
        assert "test_two_watchdogs_sharing_a_store_name_the_rank_behind" in text
    assert set(report.heartbeats) == {0, 1}
    for d in dogs:
        d.stop()


def test_a_rank_still_beating_dumps_when_asked(tmp_path: Path) -> None:
    """Rank 0 keeps beating (it is fine), rank 1 stalls: rank 1 reports, rank 0 dumps
    because it was asked to (the request path), and both end."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    dogs = [
        Watchdog(
            Topology(rank=r, world_size=2),
            timeout_s=0.4,
            poll_s=0.05,
            run_dir=tmp_path,
            store=store,
            exit_on_hang=False,
        ).start()
        for r in range(2)
    ]
    dogs[1].beat(6, "forward")
    step = 6
    deadline = time.monotonic() + 20
    while any(d.running for d in dogs) and time.monotonic() < deadline:
        step += 1
        dogs[0].beat(step)
        time.sleep(0.02)
    r0, r1 = dogs[0].report, dogs[1].report
    assert r0 is not None and not r0.reporter  # asked, not stalled itself
    assert r1 is not None and r1.reporter
    assert r1.diagnosis.laggards == (1,) and r1.diagnosis.waiting == (0,)
    assert (tmp_path / "hang" / "rank0.txt").exists()


def test_a_rank_that_never_answers_is_named_unresponsive(tmp_path: Path) -> None:
    """A peer whose watchdog thread cannot run (dead, or frozen holding the GIL) left a
    heartbeat but never acknowledges the dump request."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    peer = dist.PrefixStore("scaletrain/watchdog/attempt0", store)
    peer.set("hb/1", hb(1, 4, phase="forward", host="h1", pid=7).to_json())
    wd = Watchdog(
        Topology(rank=0, world_size=2),
        timeout_s=0.3,
        poll_s=0.05,
        grace_s=0.2,
        run_dir=tmp_path,
        store=store,
        exit_on_hang=False,
    ).start()
    wd.beat(5, "forward")
    deadline = time.monotonic() + 20
    while wd.running and time.monotonic() < deadline:
        time.sleep(0.05)
    report = wd.report
    assert report is not None and report.reporter
    assert report.diagnosis.unresponsive == (1,) and report.diagnosis.laggards == (1,)
    assert "did not answer since (dead, or frozen holding the GIL)" in report.message
    assert "host h1, pid 7" in report.message


def test_leaving_the_block_with_an_exception_is_published(tmp_path: Path) -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    wd = Watchdog(Topology(), timeout_s=5, run_dir=tmp_path, store=store)
    with pytest.raises(RuntimeError), wd:
        wd.beat(12, "forward")
        time.sleep(3 * (wd.config.poll_s or 0.5))  # the thread publishes at least once
        raise RuntimeError("boom")
    final = Heartbeat.from_json(store.get("scaletrain/watchdog/attempt0/hb/0"))
    assert final.stopped and final.step == 12 and final.phase == "left with RuntimeError"
    assert not wd.running
