"""Checkpoint directories committed in flight: prime-rl's ``update_weights_from_path`` and the RL API's ``weight_dir``.

A trainer-side writer saves each version as prime-rl's trainer does (``step_N``, sharded
safetensors with an index, then a ``STABLE`` marker), one shard per engine step, while the
engine decodes; prime-rl's inference server then calls ``collective_rpc("update_weights_from_path",
args=(weight_dir,))`` unchanged, or a client of vLLM's RL API names the directory in
``update_info``. One engine serves every case of the module.
"""

from __future__ import annotations

import contextlib
import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.engine.client import coordinator_of, tagged
from inflight.engine.engine_config import engine_kwargs
from inflight.engine.transfer_engine import RLApiError
from inflight.versions import is_monotone
from tests.engine_harness import Reference, check_serving, drive, perturbed, push_at_steps, replay
from tests.helpers import wait_until


def write_checkpoint(weight_dir: Path, state: dict[str, torch.Tensor], between=lambda shard: None) -> Path:
    """``state`` as prime-rl's trainer writes it: two shards and an index, ``STABLE`` last;
    ``between(i)`` runs before shard ``i`` is written (the test waits for an engine step)."""
    weight_dir.mkdir(parents=True)
    names = list(state)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    index = {}
    for i, shard in enumerate(shards):
        between(i)
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n].contiguous() for n in shard}, str(weight_dir / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, file))
    (weight_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (weight_dir / "STABLE").touch()
    return weight_dir


def update_from_path(llm, weight_dir: Path) -> None:
    """What prime-rl's ``POST /update_weights {"weight_dir": ...}`` runs (its server.py)."""
    llm.collective_rpc("update_weights_from_path", args=(str(weight_dir),))


@pytest.fixture(scope="module")
def engine(tiny_qwen, tmp_path_factory):
    from vllm import LLM

    llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=1024, seed=0,
              **engine_kwargs(rl_api=True))
    base = load_file(str(tiny_qwen / "model.safetensors"))
    yield llm, {0: base}, Reference(tiny_qwen, "float32"), tmp_path_factory.mktemp("broadcasts")
    with contextlib.suppress(Exception):
        llm.collective_rpc("inflight_stop")
    del llm
    gc.collect()


def test_checkpoint_directories_commit_in_flight(engine) -> None:
    """prime-rl's first call starts the idle engine on its step_1. Then three directories are
    written while 16 requests decode, each over engine steps, and land: step_2 and step_4 by
    prime-rl's call, a directory named for no step by the RL API with its version. Each
    commits after steps the engine ran since its write began; a transformers replay from the
    tags alone gives the behaviour log-probs within 1e-4, where a one-token shift does not."""
    from vllm import SamplingParams

    llm, states, ref, root = engine
    assert _started(engine) == 1
    coordinator = coordinator_of(llm)
    llm.init_weight_transfer_engine({"init_info": {"checkpoints": True}})  # the RL API's init: the same engine
    start, began = coordinator.steps, {}
    step = lambda: coordinator.steps - start  # noqa: E731

    wants_step = [False]  # the writer waits for an engine step: a held engine may take one more

    def after(mark: int) -> None:
        wants_step[0] = True
        wait_until(lambda: step() > mark, f"engine step {mark + 1}", poll_s=0.001)
        wants_step[0] = False

    def send(k: int) -> None:
        v = 2 + k
        states[v] = perturbed(states[0], seed=100 + v, scale=0.02)
        began[v] = step()
        between = lambda shard: shard and after(began[v])  # noqa: E731  (one shard per engine step)
        if v == 3:  # vLLM's RL API: the version in the payload, the commit after finish
            weight_dir = write_checkpoint(root / "trainer-output-c", states[v], between)
            llm.start_weight_update()
            llm.update_weights({"update_info": {"weight_dir": str(weight_dir), "version": v}})
            after(step())  # the client finishes once the engine decoded a step more
            llm.finish_weight_update()
        else:
            update_from_path(llm, write_checkpoint(root / f"step_{v}", states[v], between))

    marks = [4, 14, 24]
    pushes = push_at_steps(step, marks, send)
    sp = SamplingParams(temperature=1.0, max_tokens=44, logprobs=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 200 for j in range(10 + i)]} for i in range(16)]
    outs = drive(llm, coordinator, prompts, sp, hold_at=[m + 6 for m in marks], start=start,
                 release=lambda: wants_step[0])
    pushes.join()
    landed = [h for h in coordinator.history if h.ok and h.version > 1]
    assert [h.version for h in landed] == [2, 3, 4]
    for h in landed:
        assert h.step - start > began[h.version], (h.version, h.step - start, began)  # decoded meanwhile
    weights_of = lambda label: states[int(label)]  # noqa: E731
    for o in outs:
        t = tagged(o.outputs[0])
        assert is_monotone(t.versions) and set(t.versions) == {1, 2, 3, 4}, t.versions
    for o in outs[:4]:
        t = tagged(o.outputs[0])
        prompt = list(o.prompt_token_ids)
        want = replay(ref, weights_of, prompt, t.token_ids, t.labels, t.prompt_label)
        torch.testing.assert_close(torch.tensor(t.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
        off = replay(ref, weights_of, prompt, t.token_ids, t.labels[1:] + t.labels[-1:], t.prompt_label)
        assert (torch.tensor(t.logprobs, dtype=torch.float64) - off).abs().max() > 1e-3
    check_serving(llm, states, ref, 4)


def _started(engine) -> int:
    """The live version, after starting the engine on a step_1 where no case did yet."""
    llm, states, _, root = engine
    if 1 not in states:
        states[1] = perturbed(states[0], seed=101, scale=0.02)
        update_from_path(llm, write_checkpoint(root / "step_1", states[1]))
        wait_until(lambda: coordinator_of(llm).live_version == 1, "step_1 to commit on the idle engine")
    return coordinator_of(llm).live_version


def _refusal(call, match: str, status: int) -> None:
    with pytest.raises(RLApiError, match=match) as e:
        call()
    assert e.value.status == status, e.value


def test_bad_directories_are_refused_by_name_and_the_engine_serves_on(engine) -> None:
    """Refused by the call itself (400), naming the tensor or file: a missing tensor, a
    wrong shape, a truncated shard; by either path. 409: a version not newer than the live
    one. A NaN is found by the read: the next call reports it (409). The engine serves its
    last version throughout, tags unchanged; a good directory after them lands, and a retry
    of its call is answered without a second commit."""
    llm, states, ref, root = engine
    live = _started(engine)
    v, base = live + 1, states[0]
    names = list(base)
    missing = write_checkpoint(root / "bad-missing" / f"step_{v}", {n: base[n] for n in names if n != names[3]})
    _refusal(lambda: update_from_path(llm, missing), f"missing tensor {names[3]}", 400)
    shaped = write_checkpoint(root / "bad-shape" / f"step_{v}", {**base, names[-1]: base[names[-1]][:1]})
    _refusal(lambda: update_from_path(llm, shaped), f"{names[-1]} has shape \\(1,", 400)
    cut = write_checkpoint(root / "bad-cut" / f"step_{v}", base)
    shard = cut / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    _refusal(lambda: update_from_path(llm, shard.parent), f"{shard} is truncated", 400)
    llm.start_weight_update()
    _refusal(lambda: llm.update_weights({"update_info": {"weight_dir": str(cut)}}), f"{shard} is truncated", 400)
    unnamed = write_checkpoint(root / "latest", base)
    _refusal(lambda: llm.update_weights({"update_info": {"weight_dir": str(unnamed)}}), "no version", 400)
    _refusal(lambda: llm.update_weights({"update_info": {"weight_dir": str(unnamed), "version": live}}),
             f"v{live}, not newer", 409)
    _refusal(lambda: llm.finish_weight_update(), "without update_weights", 409)
    check_serving(llm, states, ref, live)

    poisoned = perturbed(base, seed=301, scale=0.02)
    poisoned[names[-1]].view(-1)[7] = float("nan")
    update_from_path(llm, write_checkpoint(root / "bad-nan" / f"step_{v}", poisoned))
    old = root / f"step_{live}"

    def reported() -> bool:  # a directory that is not newer: refused either way, the NaN first once found
        with pytest.raises(RLApiError) as e:
            update_from_path(llm, old)
        return "NaN or Inf" in str(e.value)
    wait_until(reported, "the reader to refuse the NaN directory")
    check_serving(llm, states, ref, live)
    states[v + 1] = perturbed(base, seed=302, scale=0.02)
    good = write_checkpoint(root / f"step_{v + 1}", states[v + 1])
    update_from_path(llm, good)
    wait_until(lambda: coordinator_of(llm).live_version == v + 1, f"step_{v + 1} to commit")
    commits = coordinator_of(llm).commits()
    update_from_path(llm, good)  # a client's retry (prime-rl's retries a lost answer): answered, nothing queued
    check_serving(llm, states, ref, v + 1)
    assert coordinator_of(llm).commits() == commits


@pytest.mark.slow  # an engine of its own, in prime-rl's deployment's processes (server, EngineCore, worker)
def test_prime_rls_sequence_over_http(tiny_qwen, tmp_path) -> None:
    """``vllm serve`` in its own processes, driven as prime-rl's orchestrator drives its
    server: ``/pause?mode=keep``, the update (prime-rl's route is ``engine_client.collective_rpc
    ("update_weights_from_path", args=(weight_dir,))``, which vLLM's ``/collective_rpc`` runs
    as is), ``/resume``. A bad directory answers 400 with the tensor's name; a request
    decodes while paused; the good directory's version becomes the label."""
    import requests

    from tests.engine_harness import serve_process

    base = load_file(str(tiny_qwen / "model.safetensors"))
    names = list(base)
    bad = write_checkpoint(tmp_path / "bad" / "step_1", {n: base[n] for n in names if n != names[0]})
    good = write_checkpoint(tmp_path / "step_1", perturbed(base, seed=501, scale=0.02))
    flags = ["--weight-transfer-config", '{"backend": "inflight"}']
    with serve_process(tiny_qwen, tmp_path, flags) as server:
        def update(weight_dir: Path) -> requests.Response:
            return requests.post(server + "/collective_rpc", json={"method": "update_weights_from_path",
                                                                   "args": [str(weight_dir)]}, timeout=60)

        def completes() -> bool:
            body = {"model": str(tiny_qwen), "prompt": [5, 17, 42], "max_tokens": 4, "temperature": 0.0}
            return requests.post(server + "/v1/completions", json=body, timeout=60).status_code == 200

        assert requests.post(server + "/pause", params={"mode": "keep", "clear_cache": "false"},
                             timeout=60).status_code == 200
        r = update(bad)
        assert r.status_code == 400, r.text
        assert f"missing tensor {names[0]}" in r.json()["error"]["message"], r.text
        assert update(good).status_code == 200
        assert completes()  # keep-paused, the engine decodes
        assert requests.post(server + "/resume", timeout=60).status_code == 200
        label = lambda: requests.get(server + "/weight_info", timeout=60).json()["weight_version"]  # noqa: E731
        wait_until(lambda: label() == "1", "step_1 to commit")
        assert completes()
