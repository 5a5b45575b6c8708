"""The scoring pool (``inflight.trainer.rollout.scoring_pool``): rewards off the engine's critical path.

Every test waits on results (``collect``) with a deadline that only fails a hang. The tasks
the spawned workers build live in this module (``tests`` is a package, and a spawned
worker gets this process's ``sys.path``): ``Scripted`` does what its group's first prompt
says, and rewards each completion with its length.
"""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing
import os
import random
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from inflight.trainer.envs import Arithmetic
from inflight.trainer.rollout.scoring_pool import ScoringPool
from inflight.trainer.rollout.scoring_worker import Scored, check_rewards, engine_task_factory
from inflight.trainer.tasks import Completion, Prompt, Task

HANG_S = 600.0
"""What a call waits before the test calls it a hang: generous, never a timing check
(``tests.helpers.WAIT_S``, not imported here: the spawned workers import this module, and
tests.helpers brings torch, far past their memory cap)."""
TIMEOUT_S = 5.0
"""The call timeout of the tests that exercise it (a hung call is cut off at it): far above an
ordinary call's time on a loaded machine (milliseconds)."""


# -- tasks the workers build ---------------------------------------------------------------------
class Scripted(Task):
    """``meta["do"]`` of the group's first prompt: ok, sleep (arg s), wait (until the file
    ``arg`` exists), hang (a child ``sleep``
    whose pid goes to the file ``arg``, then forever), raise, bad (returns ``arg``), alloc
    (``arg`` MiB), crash (SIGKILL itself, as the OOM killer would), async."""

    def sample(self, rng: random.Random) -> Prompt:
        return Prompt("q")

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]):  # type: ignore[override]
        do, arg = prompts[0].meta.get("do", "ok"), prompts[0].meta.get("arg")
        rewards = [float(len(c.text)) for c in completions]
        if do == "sleep":
            time.sleep(arg)
        elif do == "wait":
            while not Path(arg).exists():
                time.sleep(0.01)
        elif do == "hang":
            child = subprocess.Popen(["sleep", "600"])
            Path(arg).write_text(str(child.pid))
            while True:
                time.sleep(3600)
        elif do == "raise":
            raise ValueError("no verdict for this completion\nsecond line of the message")
        elif do == "bad":
            return arg
        elif do == "alloc":
            block = bytearray(arg << 20)
            rewards[0] += len(block) * 0
        elif do == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif do == "async":
            return self._later(rewards)
        return rewards

    async def _later(self, rewards: list[float]) -> list[float]:
        await asyncio.sleep(0.01)
        return rewards


def broken_factory() -> Task:
    raise RuntimeError("no judge configured\nmore detail")


def exiting_factory() -> Task:
    os._exit(3)


def stuck_factory() -> Task:
    time.sleep(3600)
    raise AssertionError("unreachable")


# -- helpers -------------------------------------------------------------------------------------
GOOD = [1.0, 2.0, 3.0]


def group(do: str = "ok", arg: object = None) -> tuple[list[Prompt], list[Completion]]:
    """A group of three whose ``Scripted`` rewards are ``GOOD``."""
    prompt = Prompt("q", meta={"do": do, "arg": arg})
    return [prompt] * 3, [Completion("a" * (i + 1), [i]) for i in range(3)]


def collect(pool: ScoringPool, keys: Sequence[str], within_s: float = HANG_S) -> dict[str, Scored]:
    """Poll until every key came back; each exactly once, nothing else. Keyed in arrival order."""
    got: dict[str, Scored] = {}
    deadline = time.monotonic() + within_s
    while len(got) < len(keys):
        for s in pool.poll():
            assert s.key in keys and s.key not in got, f"unexpected or repeated result {s}"
            got[s.key] = s
        assert time.monotonic() < deadline, f"no result for {sorted(set(keys) - set(got))} in {within_s} s"
        time.sleep(0.01)
    return got


def wait_until(done, what: str) -> None:
    """``tests.helpers.wait_until``, polling every 20 ms (imported in the test process only)."""
    from tests.helpers import wait_until

    wait_until(done, what, poll_s=0.02, timeout_s=HANG_S)


def gone(pid: int) -> bool:
    """No such process, or a zombie: it runs no more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def children() -> set[int]:
    """Processes whose parent is this one."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def pool():
    """Two Scripted workers, a 256 MiB cap, a timeout no well-behaved call here reaches."""
    with ScoringPool(functools.partial(Scripted), workers=2, timeout_s=30.0, memory_mb=256) as p:
        assert p.wait_ready(HANG_S)
        yield p
    assert p.pending() == 0


# -- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, named", [
    ({"workers": 0}, "workers=0"), ({"workers": 1.5}, "workers=1.5"), ({"timeout_s": 0}, "timeout_s=0"),
    ({"timeout_s": math.nan}, "timeout_s=nan"), ({"timeout_s": "5"}, "timeout_s='5'"),
    ({"memory_mb": 10}, "memory_mb=10"), ({"start_timeout_s": -1}, "start_timeout_s=-1"),
    ({"make_task": 42}, "make_task=42"), ({"make_task": lambda: Scripted()}, "cannot be pickled"),
    ({"workers": 2, "max_workers": 1}, "max_workers=1 must be an int >= workers=2"),
])
def test_settings_are_validated_naming_the_bad_value(kwargs: dict, named: str) -> None:
    kwargs = {"make_task": Scripted, **kwargs}
    before = children()
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        ScoringPool(**kwargs)
    assert children() <= before  # refused before any worker started


def test_check_rewards() -> None:
    assert check_rewards((1, True, 0.5), 3) == [1.0, 1.0, 0.5]
    for bad, named in [([1.0, math.nan], r"reward \[1\] is nan"), ([math.inf, 1.0], r"reward \[0\] is inf"),
                       ([1.0], "1 rewards for 2 completions"), ("10", r"'10' \(str\), not a list of 2"),
                       ([None, 1.0], r"reward \[0\] is None"), ([1.0, "x"], r"reward \[1\] is 'x' \(str\)")]:
        with pytest.raises(ValueError, match=named):
            check_rewards(bad, 2)


# -- results -------------------------------------------------------------------------------------
def test_plain_task_rewards_match_the_task_called_directly() -> None:
    task, rng = Arithmetic(digits=2), random.Random(3)
    groups = {}
    for g in range(4):
        prompt = task.sample(rng)
        texts = [prompt.answer, f"so {prompt.answer}", "41", f"#### {int(prompt.answer) + g}"]
        groups[f"g{g}"] = ([prompt] * 4, [Completion(t, []) for t in texts])
    with ScoringPool(functools.partial(Arithmetic, digits=2)) as pool:
        for key, (prompts, completions) in groups.items():
            pool.submit(key, prompts, completions)
        got = collect(pool, list(groups))
        assert pool.pending() == 0
    for key, (prompts, completions) in groups.items():
        assert got[key] == Scored(key, task.score(prompts, completions), "")
    assert any(0 < sum(s.rewards) < 4 for s in got.values())  # right and wrong answers both seen


def test_slow_task_blocks_neither_submit_nor_poll(pool: ScoringPool, tmp_path: Path) -> None:
    """The task scores only once the test creates ``go``, after submit and 20 polls returned:
    a submit or a poll that waited for the task would never return."""
    pool.submit("slow", *group("wait", str(tmp_path / "go")))
    polled = [pool.poll() for _ in range(20)]
    assert polled == [[]] * 20 and pool.pending() == 1  # it waits for go: nothing can be back yet
    (tmp_path / "go").touch()
    assert collect(pool, ["slow"])["slow"] == Scored("slow", GOOD, "")


def test_two_workers_return_results_in_completion_order(pool: ScoringPool, tmp_path: Path) -> None:
    assert pool.wait_ready(HANG_S)
    pool.submit("slow", *group("wait", str(tmp_path / "go")))  # done when the test says so
    pool.submit("fast", *group())
    assert list(collect(pool, ["fast"])) == ["fast"] and pool.pending() == 1
    (tmp_path / "go").touch()
    assert collect(pool, ["slow"])["slow"].rewards == GOOD


def test_async_score_is_run_to_completion(pool: ScoringPool) -> None:
    pool.submit("async", *group("async"))
    assert collect(pool, ["async"])["async"] == Scored("async", GOOD, "")


def test_raising_task_fails_the_call_with_type_message_and_class(pool: ScoringPool) -> None:
    pids = pool.pids()
    pool.submit("raises", *group("raise"))
    pool.submit("after", *group())
    got = collect(pool, ["raises", "after"])
    error = got["raises"].error
    assert got["raises"].rewards is None and not got["raises"].ok
    for part in ("'raises'", "Scripted.score", "ValueError", "no verdict for this completion"):
        assert part in error, error
    assert "second line" not in error
    assert got["after"].rewards == GOOD and pool.pids() == pids  # the worker lives on


@pytest.mark.parametrize("returned, named", [
    ([1.0, math.nan, 3.0], "reward [1] is nan"), ([math.inf, 2.0, 3.0], "reward [0] is inf"),
    ([1.0, 2.0, None], "reward [2] is None"), ([1.0, "abc", 3.0], "reward [1] is 'abc' (str), not a number"),
    ([1.0, 2.0], "2 rewards for 3 completions"), ("1.0", "'1.0' (str), not a list of 3 floats"),
    (None, "None (NoneType), not a list of 3 floats"),
])
def test_bad_rewards_fail_the_call_naming_what_and_where(pool: ScoringPool, returned: object, named: str) -> None:
    pool.submit("bad", *group("bad", returned))
    got = collect(pool, ["bad"])["bad"]
    assert got.rewards is None and named in got.error, got.error
    assert "'bad'" in got.error and "Scripted.score returned" in got.error


def test_memory_cap_fails_the_call_and_the_worker_goes_on(pool: ScoringPool) -> None:
    pids = pool.pids()
    pool.submit("huge", *group("alloc", 1024))  # 1 GiB under a 256 MiB cap
    got = collect(pool, ["huge"])["huge"]
    assert got.rewards is None and "MemoryError" in got.error and "memory_mb=256" in got.error, got.error
    pool.submit("small", *group("alloc", 16))
    assert collect(pool, ["small"])["small"].rewards == GOOD
    assert pool.pids() == pids  # a MemoryError is an error result, not a dead worker


def test_crashed_worker_fails_its_call_with_the_exit_code_and_is_replaced(pool: ScoringPool) -> None:
    pids = pool.pids()
    pool.submit("crash", *group("crash"))
    got = collect(pool, ["crash"])["crash"]
    assert got.rewards is None and "exit code -9" in got.error and "SIGKILL" in got.error and "'crash'" in got.error
    assert len(set(pids) - set(pool.pids())) == 1 and len(pool.pids()) == 2
    wait_until(lambda: all(gone(p) for p in set(pids) - set(pool.pids())), "the crashed worker's process to be gone")
    for key in ("next1", "next2"):
        pool.submit(key, *group())
    assert [s.rewards for s in collect(pool, ["next1", "next2"]).values()] == [GOOD, GOOD]


def test_hung_task_times_out_its_worker_is_killed_and_the_next_call_succeeds(tmp_path: Path) -> None:
    with ScoringPool(functools.partial(Scripted), workers=1, timeout_s=TIMEOUT_S, memory_mb=None) as pool:
        assert pool.wait_ready(HANG_S)
        [old] = pool.pids()
        pool.submit("stuck", *group("hang", str(tmp_path / "sleeper")))
        pool.submit("queued", *group())  # waits for the replacement: its deadline starts when it is sent
        got = collect(pool, ["stuck", "queued"])
        assert list(got) == ["stuck", "queued"]
        error = got["stuck"].error
        assert got["stuck"].rewards is None and "'stuck'" in error and "timed out" in error, error
        assert f"timeout_s={TIMEOUT_S:g} s" in error, error
        assert got["queued"] == Scored("queued", GOOD, "")
        [new] = pool.pids()
        assert new != old and gone(old)
        sleeper = int((tmp_path / "sleeper").read_text())
        # the verifier's own child went with its worker's group
        wait_until(lambda: gone(sleeper), f"the hung verifier's child {sleeper} to be gone")
        assert pool.counts["timeouts"] == 1


def test_failing_make_task_is_reported_at_wait_ready_and_on_every_call() -> None:
    with ScoringPool(broken_factory) as pool:
        with pytest.raises(RuntimeError, match="make_task.. raised RuntimeError: no judge configured"):
            pool.wait_ready(HANG_S)
        pool.submit("k", *group())
        got = collect(pool, ["k"])["k"]
        assert got.rewards is None and "no judge configured" in got.error and "'k'" in got.error


@pytest.mark.parametrize("factory, start_timeout_s, named", [
    (exiting_factory, 300.0, "died with exit code 3 before its task was built"),  # not a timeout: no start-up races it
    (stuck_factory, 1.0, "did not build its task within start_timeout_s=1 s"),
])
def test_a_worker_that_cannot_start_fails_one_waiting_call_per_restart(factory, start_timeout_s: float,
                                                                      named: str) -> None:
    with ScoringPool(factory, start_timeout_s=start_timeout_s) as pool:
        pool.submit("a", *group())
        pool.submit("b", *group())
        got = collect(pool, ["a", "b"])
        assert all(s.rewards is None and named in s.error and "no scoring worker could start" in s.error
                   for s in got.values()), got
        with pytest.raises(RuntimeError, match=named):
            pool.wait_ready(HANG_S)
        assert pool.pids() == [] and pool.pending() == 0  # down until calls wait again


def test_submit_refuses_misuse_and_reports_an_unpicklable_group(pool: ScoringPool) -> None:
    with pytest.raises(ValueError, match="3 prompts for 2 completions"):
        pool.submit("x", group()[0], group()[1][:2])
    pool.submit("dup", *group("sleep", 0.2))
    with pytest.raises(ValueError, match="'dup' is already pending"):
        pool.submit("dup", *group())
    prompts, completions = group()
    pool.submit("lambda", [Prompt("q", meta={"f": lambda: 0})] * 3, completions)
    got = collect(pool, ["dup", "lambda"])
    assert got["dup"].rewards == GOOD and "cannot be pickled" in got["lambda"].error
    pool.submit("dup", prompts, completions)  # returned by poll: the key is free again
    assert collect(pool, ["dup"])["dup"].rewards == GOOD


def test_the_ledger_balances_under_a_mix_of_everything(tmp_path: Path) -> None:
    mix = {"ok0": ("ok", None), "hang": ("hang", str(tmp_path / "sleeper")), "raise": ("raise", None),
           "nan": ("bad", [math.nan, 1.0, 1.0]), "short": ("bad", [1.0]), "word": ("bad", "x"),
           "huge": ("alloc", 1024), "crash": ("crash", None), "async": ("async", None), "sleep": ("sleep", 0.2),
           "ok1": ("ok", None), "crash2": ("crash", None), "ok2": ("ok", None), "ok3": ("ok", None)}
    with ScoringPool(functools.partial(Scripted), workers=2, timeout_s=TIMEOUT_S, memory_mb=256) as pool:
        for key, (do, arg) in mix.items():
            pool.submit(key, *group(do, arg))
        assert pool.pending() == len(mix)
        got = collect(pool, list(mix))
        assert pool.pending() == 0 and pool.poll() == []
        pids = pool.pids()
    ok = {k for k, s in got.items() if s.ok}
    assert ok == {"ok0", "ok1", "ok2", "ok3", "async", "sleep"}
    assert all(got[k].rewards == GOOD for k in ok)
    assert "timed out" in got["hang"].error and "exit code -9" in got["crash2"].error
    assert "MemoryError" in got["huge"].error and "reward [0] is nan" in got["nan"].error
    counts = pool.counts
    assert counts["submitted"] == len(mix) == counts["scored"] + counts["failed"] and counts["failed"] == 8
    assert counts["timeouts"] == 1 and counts["deaths"] == 2
    assert all(gone(p) for p in pids)


def test_close_leaves_no_child_and_returns_what_was_outstanding(tmp_path: Path) -> None:
    before, mp_before = children(), {p.pid for p in multiprocessing.active_children()}
    pool = ScoringPool(functools.partial(Scripted), workers=2, timeout_s=30.0)
    assert pool.wait_ready(HANG_S)
    pids = pool.pids()
    assert children() - before == set(pids)  # the workers and nothing else (no helper process)
    pool.submit("stuck", *group("hang", str(tmp_path / "sleeper")))
    pool.submit("slow", *group("sleep", 30.0))
    pool.submit("queued", *group())
    wait_until(lambda: (tmp_path / "sleeper").exists(), "the hung verifier to write its child's pid")
    pool.close()
    pool.close()  # twice is fine
    got = {s.key: s for s in pool.poll()}  # all there at once: the first poll after close returns them
    assert sorted(got) == ["queued", "slow", "stuck"], got
    assert all(s.rewards is None and "closed before it was scored" in s.error for s in got.values())
    assert pool.pending() == 0
    assert not children() - before and {p.pid for p in multiprocessing.active_children()} <= mp_before
    assert all(gone(p) for p in pids)
    sleeper = int((tmp_path / "sleeper").read_text())
    wait_until(lambda: gone(sleeper), f"the hung verifier's child {sleeper} to be gone")  # it too
    with pytest.raises(RuntimeError, match="after close"):
        pool.submit("late", *group())


def score_in_daemon(conn) -> None:
    """As a TP=1 engine runs: a daemonic ``multiprocessing`` child (which may not start
    ``multiprocessing`` children of its own)."""
    with ScoringPool(functools.partial(Scripted)) as pool:
        pool.submit("k", *group())
        got = collect(pool, ["k"])["k"]
    conn.send((got.key, got.rewards, got.error))


def test_pool_runs_inside_a_daemonic_process_as_the_engine_is() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    engine = ctx.Process(target=score_in_daemon, args=(child,), daemon=True)
    engine.start()
    child.close()
    assert parent.poll(HANG_S), "the daemonic process sent nothing"
    assert parent.recv() == ("k", GOOD, "")
    engine.join(HANG_S)
    assert engine.exitcode == 0


# -- the engine's task ---------------------------------------------------------------------------
def test_engine_task_factory_scores_as_the_engine_does_under_the_default_cap(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.envs import RepeatDigit
    from inflight.trainer.tiny_model import default_corpus, train_tokenizer

    train_tokenizer(default_corpus(), tmp_path)
    cfg = config_from_dict({"task": {"name": "repeat_digit", "completion_tokens": 4}})
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    prompts = [Prompt("repeat: 7", "7")] * 3
    completions = [Completion("", tok(text, add_special_tokens=False).input_ids) for text in ("7777", "7 3 x", "xyz")]
    with ScoringPool(engine_task_factory(cfg, str(tmp_path))) as pool:  # memory_mb=2048: transformers fits
        pool.submit("g", prompts, completions)
        got = collect(pool, ["g"])["g"]
    assert got == Scored("g", RepeatDigit(tok, 4).score(prompts, completions), "")


def test_a_reasoning_gym_mix_scores_in_the_engine_pool_as_called_directly(tmp_path: Path) -> None:
    """``task.name = "reasoning_gym"`` built as the engine builds it, in a worker under the
    default memory cap: each prompt carries its entry, and the rewards equal the task's own."""
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.envs import build_task
    from inflight.trainer.tiny_model import default_corpus, train_tokenizer

    train_tokenizer(default_corpus(), tmp_path)
    cfg = config_from_dict({"task": {"name": "reasoning_gym", "reasoning_gym": {
        "datasets": ["basic_arithmetic", "spell_backward"], "seed": 7}}})
    task, rng = build_task(cfg, tokenizer=None), random.Random(2)
    groups = {}
    for g in range(4):
        p = task.sample(rng)
        texts = [f"<answer>{p.answer}</answer>", "<answer>?</answer>", p.answer, f"<answer>{p.answer}</answer>."]
        groups[f"g{g}"] = ([p] * 4, [Completion(t, []) for t in texts])
    with ScoringPool(engine_task_factory(cfg, str(tmp_path)), timeout_s=120.0) as pool:
        for key, (prompts, completions) in groups.items():
            pool.submit(key, prompts, completions)
        got = collect(pool, list(groups), within_s=600.0)
    for key, (prompts, completions) in groups.items():
        assert got[key] == Scored(key, task.score(prompts, completions), "")
        assert got[key].rewards[0] == 1.0 and got[key].rewards[2] == 0.0


# -- growth and cancelling -------------------------------------------------------------------
def test_a_hung_call_holds_one_worker_and_the_others_run_on_a_grown_one(tmp_path: Path) -> None:
    """One worker, room for two: a call that hangs (an environment's tool, past any timeout
    the test waits for) holds its worker; the calls after it run on a second worker started
    for them, all of them before the hung one ends. Cancelling it kills its worker (and the
    verifier's child) and counts it cancelled, not failed."""
    with ScoringPool(functools.partial(Scripted), workers=1, max_workers=2, timeout_s=HANG_S, memory_mb=None) as pool:
        assert pool.wait_ready(HANG_S)
        [first] = pool.pids()
        pool.submit("stuck", *group("hang", str(tmp_path / "sleeper")))
        wait_until(lambda: (tmp_path / "sleeper").exists(), "the hung call to start its child")
        keys = [f"after{i}" for i in range(6)]
        for key in keys:
            pool.submit(key, *group())
        got = collect(pool, keys)  # "stuck" coming back among them fails collect: it must still hang
        assert all(s == Scored(s.key, GOOD, "") for s in got.values())
        assert pool.counts["grown"] == 1 and len(pool.pids()) == 2 and first in pool.pids()
        pool.cancel(["stuck", "after0", "never-submitted"], "group g was dropped")  # only "stuck" is pending
        [stuck] = collect(pool, ["stuck"]).values()
        assert stuck.rewards is None and stuck.cancelled and stuck.error == (
            "key 'stuck': cancelled while it ran (group g was dropped); its worker (pid "
            f"{first}) was killed and replaced")
        wait_until(lambda: gone(first) and gone(int((tmp_path / "sleeper").read_text())),
                   "the cancelled call's worker and its child to be gone")
        pool.submit("next", *group())
        assert collect(pool, ["next"])["next"] == Scored("next", GOOD, "")
        assert {k: pool.counts[k] for k in ("cancelled", "failed", "timeouts", "scored", "grown")} == {
            "cancelled": 1, "failed": 0, "timeouts": 0, "scored": 7, "grown": 1}
        assert len(pool.pids()) == 2  # the replacement took the slot; nothing grew past max_workers


def test_cancel_takes_queued_calls_out_before_they_run(tmp_path: Path) -> None:
    with ScoringPool(functools.partial(Scripted), workers=1, timeout_s=HANG_S, memory_mb=None) as pool:
        assert pool.wait_ready(HANG_S)
        gate = tmp_path / "gate"
        pool.submit("blocker", *group("wait", str(gate)))
        pool.submit("queued1", *group("raise"))  # would fail if it ran: cancelled, it is not run
        pool.submit("queued2", *group())
        pool.cancel(["queued1"], "group q was dropped")
        got = collect(pool, ["queued1"])
        assert got["queued1"] == Scored("queued1", None, "key 'queued1': cancelled before it ran (group q was dropped)",
                                        cancelled=True)
        gate.touch()
        got = collect(pool, ["blocker", "queued2"])
        assert list(got) == ["blocker", "queued2"] and all(s.rewards == GOOD for s in got.values())
        assert pool.counts["cancelled"] == 1 and pool.counts["failed"] == 0 and pool.counts["grown"] == 0
        assert pool.pending() == 0


def test_a_raising_task_sends_its_traceback_for_the_engine_log(pool: ScoringPool) -> None:
    pool.submit("tb", *group("raise"))
    got = collect(pool, ["tb"])["tb"]
    assert got.error == "key 'tb': Scripted.score raised ValueError: no verdict for this completion"
    assert got.trace.startswith("Traceback (most recent call last):") and 'raise ValueError("no verdict' in got.trace
    assert got.trace.rstrip().endswith("ValueError: no verdict for this completion\nsecond line of the message")
