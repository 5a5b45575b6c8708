"""A user script with an in-flight ``LLM`` and a trainer in another process
ends with status 0 and no stack traces, whatever leaves first.

Each case runs two fresh interpreters, the user's engine script (``LLM`` in-process) and a
trainer script that pushes one version, and orders their exits (what is tested):

- ``trainer_first``: the trainer closes its pusher and exits; then the script ends;
- ``trainer_vanishes``: the trainer's script ends without calling ``close`` (its atexit says
  goodbye); then the script ends;
- ``engine_first``: the engine script ends while the trainer lives (its atexit stops the
  listener and the coordinator); the trainer sees the engine's ``left`` mark, then closes;
- ``del_llm``: ``del llm`` (the engine's shutdown hook), then the trainer closes.

Each step waits for an event (a line a process printed, its exit, a store key), never a time.
The trainer hosts the group's store, so it holds the port (``reserve_port``) and prints it;
the engine script is started on that port.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import WAIT_S

ENGINE = r"""
import gc, sys
from vllm import LLM, SamplingParams
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.engine.client import start_inflight, tagged
from inflight.transport.group_config import GroupConfig
model, port = sys.argv[1], int(sys.argv[2])
llm = LLM(model, enforce_eager=True, dtype="float32", max_model_len=256, **engine_kwargs())
start_inflight(llm, InflightConfig(group=GroupConfig(port=port, world_size=2, timeout_s=60)))
print("STARTED", flush=True)
sys.stdin.readline()  # the trainer pushed v1
out = llm.generate(["1+1="], SamplingParams(max_tokens=4, logprobs=0), use_tqdm=False)[0].outputs[0]
print("VERSIONS", tagged(out).versions, flush=True)
if sys.stdin.readline().strip() == "del":
    del llm
    gc.collect()
    print("DELETED", flush=True)
    sys.stdin.readline()
print("ENGINE END", flush=True)
"""

TRAINER = r"""
import sys
from safetensors.torch import load_file
from inflight.transport.group_config import GroupConfig
from inflight.transport.store import reserve_port, wait_key
from inflight.transport.pusher import PushConfig, WeightPusher
model, port = sys.argv[1], reserve_port()
print("PORT", port, flush=True)
pusher = WeightPusher(GroupConfig(port=port, world_size=2, timeout_s=60), PushConfig(bucket_mb=0.25),
                      join_timeout_s=600)
pusher.push(1, load_file(model + "/model.safetensors"))
print("PUSHED", flush=True)
how = sys.stdin.readline().strip()
if how == "await_left":  # the engine stopped first: it marks left/<rank> on its way out
    wait_key(pusher.group.store, "left/1", timeout_s=600, stop=None, what="the engine leaving", who="trainer")
if how != "vanish":  # "vanish": the script just ends; its exit must say goodbye
    pusher.close()
print("TRAINER END", flush=True)
"""

NOISE = ("Traceback", "terminate called", "TCPStore.cpp", "c10d", "Aborted", "frame #")


class _Proc:
    def __init__(self, source: str, args: list[str], tmp: Path, name: str) -> None:
        (tmp / f"{name}.py").write_text(source)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        env.pop("INFLIGHT_SECRET", None)
        self.name = name
        self.err = open(tmp / f"{name}.err", "w+")
        self.p = subprocess.Popen([sys.executable, str(tmp / f"{name}.py"), *args], env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)
        self.lines: list[str] = []
        self._read: queue.Queue[str | None] = queue.Queue()  # its stdout, line by line; None at its end
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    def _read_stdout(self) -> None:
        for line in self.p.stdout:
            self._read.put(line)
        self._read.put(None)

    def expect(self, word: str) -> str:
        """Block until the process prints a line starting with ``word`` (an event: ``WAIT_S``
        only bounds a hang)."""
        deadline = time.monotonic() + WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._read.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self._read.put(None)  # the end stays the end for the next reader
                raise AssertionError(f"the {self.name} exited without {word!r}: {self.output()[-4000:]}")
            self.lines.append(line)
            if line.startswith(word):
                return line
        raise AssertionError(f"waited {WAIT_S:.0f} s for the {self.name} to print {word!r}: {self.output()[-4000:]}")

    def say(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def finish(self) -> int:
        try:
            code = self.p.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"waited {WAIT_S:.0f} s for the {self.name} to exit: "
                                 f"{self.output()[-4000:]}") from None
        self._reader.join(WAIT_S)
        assert not self._reader.is_alive(), f"waited {WAIT_S:.0f} s for the end of the {self.name}'s output"
        while (line := self._read.get_nowait()) is not None:
            self.lines.append(line)
        self._read.put(None)
        return code

    def output(self) -> str:
        self.err.seek(0)
        return "".join(self.lines) + self.err.read()


@pytest.mark.parametrize("order", ["trainer_first", "trainer_vanishes", "engine_first", "del_llm"])
def test_script_exits_cleanly_in_any_shutdown_order(order: str, tiny_llama, tmp_path: Path) -> None:
    trainer = _Proc(TRAINER, [str(tiny_llama)], tmp_path, "trainer")
    port = trainer.expect("PORT").split()[1]
    engine = _Proc(ENGINE, [str(tiny_llama), port], tmp_path, "engine")
    try:
        engine.expect("STARTED")
        trainer.expect("PUSHED")
        engine.say("pushed")
        assert engine.expect("VERSIONS").strip() == "VERSIONS [1, 1, 1, 1]"
        if order in ("trainer_first", "trainer_vanishes"):
            trainer.say("close" if order == "trainer_first" else "vanish")
            assert trainer.finish() == 0
            engine.say("exit")
            assert engine.finish() == 0
        elif order == "engine_first":
            engine.say("exit")
            assert engine.finish() == 0
            trainer.say("await_left")
            assert trainer.finish() == 0
        else:
            engine.say("del")
            engine.expect("DELETED")
            trainer.say("close")
            assert trainer.finish() == 0
            engine.say("exit")
            assert engine.finish() == 0
    finally:
        for proc in (engine, trainer):
            if proc.p.poll() is None:
                proc.p.kill()
    out = engine.output() + trainer.output()
    assert "ENGINE END" in out and "TRAINER END" in out, out[-6000:]
    noisy = [line for line in out.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, "\n".join(noisy[:20])
    said = [line for line in engine.output().splitlines() if "the trainer left" in line]
    assert len(said) == (1 if order in ("trainer_first", "trainer_vanishes") else 0), said
