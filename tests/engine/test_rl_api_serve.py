"""vLLM's RL API over HTTP on ``vllm serve --weight-transfer-config '{"backend": "inflight"}'``.

The server is started as a user would; vLLM's own ``HTTPVLLMWeightSyncClient`` drives the
handshake through ``WeightTransferTrainerFactory``, and a script sends TRL's exact sequence
(pause keep, start, update, finish with a version, resume) by hand. Tokens stream from the
token-in/token-out ``/inference/v1/generate`` endpoint throughout; its version spans are
replayed in transformers.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import load_file

from inflight.protocol import Sampling
from inflight.trainer.transfer_trainer import InflightTrainerInitInfo, update_info
from inflight.transport.pusher import PushConfig
from inflight.versions import boundaries, labels_from_spans, tags_from_spans
from tests.engine_harness import Reference, perturbed, replay, serve_process
from tests.helpers import WAIT_S, wait_until

BACKEND_FLAGS = ["--weight-transfer-config", '{"backend": "inflight"}', "--enable-scale-out", "--max-model-len", "1024",
                 "--trust-request-chat-template",  # the tiny tokenizer has no chat template: a request brings one
                 "--return-tokens-as-token-ids"]  # as renderers (verifiers' TrainClient) read log-probs
TOKENS = 990
"""Each request's length: long enough for every push to land while it decodes."""


class Stream(threading.Thread):
    """One sampled request streamed from ``/inference/v1/generate``: its tokens, behaviour
    log-probs and (from the final chunk) version spans, and how far it has got."""

    def __init__(self, base: str, i: int, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.rid, self.prompt, self.max_tokens, self.seed = base, f"req-{i}", prompt, max_tokens, i
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[dict] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        body = {"request_id": self.rid, "token_ids": self.prompt, "stream": True,
                "sampling_params": {"max_tokens": self.max_tokens, "temperature": 1.0, "logprobs": 0,
                                    "ignore_eos": True, "seed": self.seed}}
        try:
            with requests.post(self.base + "/inference/v1/generate", json=body, stream=True, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        self._take(json.loads(line[6:])["choices"][0])
        except BaseException as e:  # read by the test
            self.error = e

    def _take(self, choice: dict) -> None:
        self.logprobs += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []]
        self.tokens += choice.get("token_ids") or []
        if choice.get("weight_versions"):
            self.spans = choice["weight_versions"]

    @property
    def engine_id(self) -> str:
        """The id the engine knows the request by (the endpoint prefixes the client's)."""
        return f"generate-tokens-{self.rid}"

    @property
    def progress(self) -> int:
        return len(self.tokens)

    def finished(self) -> bool:
        self.join(600)
        assert self.error is None and not self.is_alive(), self.error
        assert self.spans is not None and len(self.tokens) == len(self.logprobs) == self.max_tokens
        return True

    def labels(self) -> list[str]:
        return labels_from_spans([_Span(**s) for s in self.spans], len(self.tokens))


class _Span:
    def __init__(self, version: str, start: int, end: int) -> None:
        self.version, self.start, self.end = version, start, end


@pytest.fixture(scope="module")
def group_port(hold_port):
    """The engine joins one weight group for its life: every trainer of this module hosts it on this port."""
    return hold_port()


@pytest.fixture(scope="module")
def server(tiny_qwen, tmp_path_factory):
    with serve_process(tiny_qwen, tmp_path_factory.mktemp("rl_api_serve"), BACKEND_FLAGS) as base:
        yield base


def _episodes(cfg, model_dir, tok, add, abort, prompts: dict, finished) -> tuple[dict, dict]:
    """``prompts`` (group id -> Prompt) as episodes through ``EpisodeRollout``; ``finished()``
    returns the turns that ended, ``(request id, replies or None, error)``. Returns the samples
    by id and the ledger."""
    from inflight.trainer.rollout.episode_rollout import EpisodeRollout
    from inflight.trainer.tasks import encode_prompt

    rollout = EpisodeRollout(cfg, str(model_dir), "e0", Sampling(), tok, add, abort, episodic=True)
    samples, deadline = {}, time.monotonic() + WAIT_S  # renewed whenever a turn ends: a bound for a hang
    try:
        rollout.wait_ready()
        for gid, prompt in prompts.items():
            rollout.start_group(gid, prompt, encode_prompt(tok, prompt, "auto"))
        while rollout.groups:
            assert time.monotonic() < deadline, f"waited {WAIT_S:.0f} s for a turn (groups {sorted(rollout.groups)})"
            for rid, replies, error in finished():
                deadline = time.monotonic() + WAIT_S
                rollout.submit_turn(rid, replies) if replies is not None else rollout.fail_turn(rid, error)
            for group in rollout.collect():
                samples.update({s.sample_id: s for s in group.samples})
            time.sleep(0.002)
    finally:
        rollout.close()
    return samples, rollout.counts


def _late(request_id: str, finished):
    """``finished``, holding back the turn ``request_id`` until a turn fails, then giving both
    at once, the failure first: a reply that arrives after its group was dropped."""
    held: list = []

    def late() -> list:
        out = finished()
        held.extend(t for t in out if t[0] == request_id)
        out = [t for t in out if t[0] != request_id]
        if held and any(t[1] is None for t in out):
            out, held[:] = out + held, []
        return out
    return late


def test_episodes_over_the_server_sample_what_they_sample_in_process(server, tiny_qwen, group_port, hold_port,
                                                                     caplog) -> None:
    """The same episodes (``tests.episode_envs``: 3 turns, the environment's tokens between
    them) run as clients of the engine's server (``ServerTurns``: each turn one
    ``/inference/v1/generate`` request of the episode's token ids) and in-process (an engine
    stepped here), each request seeded from its id: the samples are the same tokens, and
    the same log-probs and version tags. A turn the server refuses (an observation past its
    context) fails its episode alone, named by its request; its group is dropped (a reply of it
    that comes back later is dropped too), the other trains, and the ledger balances. Runs first in this module: the
    server serves version 0, once a trainer has joined (before, its tokens are labelled vLLM's "default": refused)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.sampling_params import RequestOutputKind

    from inflight.engine.client import start_inflight, tagged
    from inflight.engine.engine_config import InflightConfig, engine_kwargs
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.rollout.server_turns import ServerTurns, request_seed
    from inflight.trainer.tasks import Prompt
    from inflight.transport.group_config import GroupConfig
    from inflight.transport.pusher import WeightPusher
    from tests.engine_harness import stop_engine

    cfg = config_from_dict({"task": {"name": "tests.episode_envs:make", "completion_tokens": 6, "options": {"turns": 3},
                                     "episode": {"max_tokens": 4000}},  # the server, not the driver, refuses "overlong"
                            "rollout": {"group_size": 2}, "engine": {"max_model_len": 4096}})
    rng = __import__("random").Random(11)
    words = lambda: " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(40))  # noqa: E731
    prompts = {"g0": Prompt(words()), "g1": Prompt(words())}
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_qwen))

    info = InflightTrainerInitInfo(rank=0, port=group_port, push=PushConfig(dtype="float32"), timeout_s=60.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server),
                                                        source=load_file(str(tiny_qwen / "model.safetensors")))
    turns = ServerTurns(server, {"temperature": 1.0, "ignore_eos": True}, run_seed=0)
    try:
        remote, remote_counts = _episodes(cfg, tiny_qwen, tok, turns.add_request, turns.abort, prompts,
                                          turns.finished)
        faulty, faulty_counts = _episodes(cfg, tiny_qwen, tok, turns.add_request, turns.abort,
                                          {"f0": Prompt(words(), meta={"fault": "overlong"}), "f1": Prompt(words())},
                                          _late("f0.0.0", turns.finished))
    finally:
        turns.close()
        trainer.shutdown()

    llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", seed=0, max_model_len=1024, **engine_kwargs())
    group = GroupConfig(port=hold_port(), world_size=2, timeout_s=120)
    start_inflight(llm, InflightConfig(group=group))
    pusher = WeightPusher(group, PushConfig(dtype="float32"))
    done: list = []

    def add(rid, prompt, ids, max_tokens, n) -> None:
        params = SamplingParams(n=n, temperature=1.0, ignore_eos=True, max_tokens=max_tokens, logprobs=0,
                                seed=request_seed(0, rid), output_kind=RequestOutputKind.FINAL_ONLY)
        llm.llm_engine.add_request(rid, {"prompt_token_ids": ids}, params)

    def finished() -> list:
        if llm.llm_engine.has_unfinished_requests():
            done.extend((o.request_id, [tagged(c) for c in o.outputs], "") for o in llm.llm_engine.step() if o.finished)
        out = list(done)
        done.clear()
        return out
    try:
        local, local_counts = _episodes(cfg, tiny_qwen, tok, add, llm.llm_engine.abort_request, prompts, finished)
    finally:
        pusher.close()
        stop_engine(llm)

    assert sorted(remote) == sorted(local) == ["g0-0", "g0-1", "g1-0", "g1-1"]
    for sid in remote:
        r, s = remote[sid], local[sid]
        assert r.token_ids == s.token_ids and r.observation == s.observation and r.versions == s.versions, sid
        assert sum(not o for o in r.observation) == 18 and r.reward == s.reward, sid
        assert float(torch.tensor(r.logprobs).sub(torch.tensor(s.logprobs)).abs().max()) < 1e-5, sid
    assert remote_counts == local_counts == {"started": 4, "finished": 4, "failed": 0, "dropped": 0, "shipped": 4,
                                             "groups_scored": 2, "groups_failed": 0, "resumed": 0,
                                             "turns_cancelled": 0}
    assert sorted(faulty) == ["f1-0", "f1-1"], sorted(faulty)
    c = faulty_counts
    assert c["started"] == 4 == c["finished"] + c["failed"] + c["dropped"] and c["groups_failed"] == 1, c
    assert c["failed"] == 1 and c["dropped"] == 1, c  # f0.1 failed, f0.0's held reply came back to no group
    failure = [r.getMessage() for r in caplog.records if "episode f0." in r.getMessage()]
    assert len(failure) == 1 and "(turn 1) failed" in failure[0] and "/inference/v1/generate failed" in failure[0] \
        and "HTTP 400" in failure[0], failure


class ProgressAfterStart:
    """vLLM's ``HTTPVLLMWeightSyncClient``, called as it is; between ``start`` and ``update``
    this trainer waits for every stream to take 2 more tokens, so each update is shown to
    start while the engine decodes (an event, never a deadline)."""

    def __init__(self, base: str, streams: list[Stream]) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.http = HTTPVLLMWeightSyncClient(base)
        self.streams = streams
        self.at_start: list[list[int]] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.http.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.http.start_weight_update()
        self.at_start.append([s.progress for s in self.streams])

    def update_weights(self, info) -> None:
        mark = self.at_start[-1]
        wait_until(lambda: all(s.progress >= m + 2 or not s.is_alive() for s, m in zip(self.streams, mark)),
                   "2 tokens of every stream after start_weight_update")
        assert all(s.is_alive() for s in self.streams), "a request ended before every update started"
        self.http.update_weights(info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.http.finish_weight_update(weight_version)


def test_http_client_pushes_five_versions_while_sixteen_requests_stream(server, tiny_qwen, group_port) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    base = load_file(str(tiny_qwen / "model.safetensors"))
    states = {0: base}
    streams: list[Stream] = []
    client = ProgressAfterStart(server, streams)
    info = InflightTrainerInitInfo(rank=0, port=group_port, push=PushConfig(dtype="float32", bucket_mb=0.25),
                                   timeout_s=60.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=base)
    # after init: what the engine sampled before it is labelled vLLM's "default", not a version
    streams += [Stream(server, i, [3 + (5 * i + j) % 250 for j in range(8 + i)], TOKENS) for i in range(16)]
    results = []
    try:
        for k in range(5):
            wait_until(lambda k=k: (min(s.progress for s in streams) >= 16 * (k + 1)
                                    or any(not s.is_alive() for s in streams)),
                       f"every stream at {16 * (k + 1)} tokens")
            states[k + 1] = trainer.source = perturbed(base, seed=200 + k, scale=0.02)
            results.append(trainer.send_weights())
        assert all(s.is_alive() for s in streams), "a request ended before every commit landed"
    finally:
        trainer.shutdown()
    assert [r.version for r in results] == [1, 2, 3, 4, 5]
    ref = Reference(tiny_qwen, "float32")
    for s in streams:
        assert s.finished()
        first = boundaries(tags_from_spans([_Span(**x) for x in s.spans], len(s.tokens)))
        assert set(first) == set(range(6)), first
        for r, marks in zip(results, client.at_start):
            at_commit = r.commits[1].tokens_at_commit[s.engine_id]
            assert first[r.version] == at_commit > marks[streams.index(s)], (r.version, at_commit)
    for s in streams[:3]:  # a transformers replay from the spans alone; a one-token shift of them fails
        labels = s.labels()
        want = replay(ref, lambda label: states[int(label)], s.prompt, s.tokens, labels, labels[0])
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        off = replay(ref, lambda label: states[int(label)], s.prompt, s.tokens, labels[1:] + labels[-1:], labels[0])
        assert (got - off).abs().max() > 1e-3


def _post(server: str, path: str, **kw) -> requests.Response:
    r = requests.post(server + path, timeout=60, **kw)
    return r


def test_trl_sequence_keeps_decoding_and_labels_at_the_commit(server, tiny_qwen, group_port) -> None:
    """pause(keep) -> start -> update -> finish(version) -> resume, as TRL's AsyncGRPO sends
    them, with the bytes pushed beside it: tokens flow between pause and resume, the label
    does not move at finish, and it moves at the commit step."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    base = load_file(str(tiny_qwen / "model.safetensors"))
    info = InflightTrainerInitInfo(rank=0, port=group_port, push=PushConfig(dtype="float32", bucket_mb=0.25),
                                   timeout_s=60.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server), source=base)
    live = trainer.version
    v = live + 1
    stream = Stream(server, 99, [7, 8, 9, 10], TOKENS)
    try:
        wait_until(lambda: stream.progress >= 8, "the request to stream")
        r = _post(server, "/update_weights", json={"update_info": update_info(v, base, "float32")})
        assert r.status_code >= 400 and "update_weights before start_weight_update" in r.text, r.text
        assert _post(server, "/pause", params={"mode": "keep"}).ok
        assert requests.get(server + "/is_paused", timeout=60).json() == {"is_paused": False}
        assert _post(server, "/start_weight_update").ok
        paused_at = stream.progress
        wait_until(lambda: stream.progress >= paused_at + 4, "tokens while a client holds a keep-pause")
        state = perturbed(base, seed=300, scale=0.02)
        assert _post(server, "/update_weights", json={"update_info": update_info(v, state, "float32")}).ok
        trainer.pusher.send(v, state)  # staged on the worker while it decodes
        assert _post(server, "/finish_weight_update", json={"weight_version": str(v)}).ok
        assert requests.get(server + "/weight_info", timeout=60).json() == {"weight_version": str(live)}
        commits = trainer.pusher.commit(v)
        assert requests.get(server + "/weight_info", timeout=60).json() == {"weight_version": str(v)}
        assert _post(server, "/resume").ok
        r = _post(server, "/update_weight_version", json={"new_version": str(v + 3)})
        assert r.status_code >= 400 and f"weight_version={v + 3} names no update" in r.text, r.text
    finally:
        trainer.shutdown()
    assert stream.finished()
    first = boundaries(tags_from_spans([_Span(**x) for x in stream.spans], len(stream.tokens)))
    assert first[v] == commits[1].tokens_at_commit[stream.engine_id] > paused_at
    assert _post(server, "/pause", params={"mode": "abort"}).ok  # abort (and wait) still pause
    assert requests.get(server + "/is_paused", timeout=60).json() == {"is_paused": True}
    assert _post(server, "/resume").ok
    assert requests.get(server + "/is_paused", timeout=60).json() == {"is_paused": False}


def _misuses(base: dict, live: int, port: int) -> list[tuple[str, dict | None, int, str]]:
    """Issue 52's misuses in an order the engine can take them: (route, body, status, what the
    message says). The update opened by the one good call is closed by the last misuse."""
    nxt = update_info(live + 1, base, "float32")
    name, shape = nxt["names"][0], nxt["shapes"][0]
    unknown = {**nxt, "names": ["model.no_such.weight"] + nxt["names"][1:]}
    reshaped = {**nxt, "shapes": [[3, 3]] + nxt["shapes"][1:]}
    return [("/update_weights", {"update_info": nxt}, 409, "inflight: update_weights before start_weight_update"),
            ("/finish_weight_update", None, 409, "inflight: finish_weight_update without start_weight_update"),
            ("/update_weight_version", {"new_version": str(live + 7)}, 409, f"weight_version={live + 7} names no "
             "update"),
            ("/update_weight_version", {"new_version": "step-3"}, 400, "weight_version='step-3' must be an integer"),
            ("/start_draft_weight_update", None, 400, "draft model updates are refused"),
            ("/init_weight_transfer_engine", {"init_info": {"group": {"port": port + 1, "world_size": 2}}}, 409,
             "init_weight_transfer_engine twice with another config (fields ['group'] differ)"),
            ("/init_weight_transfer_engine", {"init_info": {"no_such_field": 1}}, 400, "no_such_field"),
            ("/start_weight_update", None, 200, ""),
            ("/start_weight_update", None, 409, "start_weight_update while an update is open"),
            ("/update_weights", {"update_info": unknown}, 400, "names tensors this engine does not have"),
            ("/update_weights", {"update_info": reshaped}, 400, f"{name} has shape (3, 3), this engine's is "
             f"{tuple(shape)}"),
            ("/update_weights", {"update_info": update_info(live, base, "float32")}, 409,
             f"update_info.version={live} is not newer"),
            ("/finish_weight_update", None, 409, "finish_weight_update without update_weights")]


def test_each_misuse_answers_its_status_with_its_message(server, tiny_qwen, group_port) -> None:
    """A client's mistake on the RL routes answers 4xx (409 a call out of order or against the
    engine's state, 400 bad input), its body the refusal's own message (no utility-call prefix,
    no status mark); vLLM's ``HTTPVLLMWeightSyncClient`` raises with the status, the message in
    its response. The engine serves its version on."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    base = load_file(str(tiny_qwen / "model.safetensors"))
    info = InflightTrainerInitInfo(rank=0, port=group_port, push=PushConfig(dtype="float32", bucket_mb=0.25),
                                   timeout_s=60.0)
    client = HTTPVLLMWeightSyncClient(server)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=base)
    live = trainer.version
    try:
        for path, body, status, says in _misuses(base, live, group_port):
            r = _post(server, path, **({} if body is None else {"json": body}))
            assert r.status_code == status, (path, body and list(body), r.status_code, r.text)
            if status != 200:
                error = r.json()["error"]
                assert error["code"] == status and error["message"].startswith("inflight: "), (path, error)
                assert says in error["message"] and "(HTTP" not in error["message"], (path, error["message"])
        with pytest.raises(requests.HTTPError, match="409 Client Error: Conflict") as raised:
            client.update_weights(update_info(live + 1, base, "float32"))
        assert "update_weights before start_weight_update" in raised.value.response.json()["error"]["message"]
    finally:
        trainer.shutdown()
    assert requests.get(server + "/weight_info", timeout=60).json() == {"weight_version": str(live)}
    assert Stream(server, 77, [5, 6, 7], 8).finished()  # and decodes


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""The tiny model's tokenizer has no chat template: the request brings one."""


def test_openai_endpoints_return_version_spans(server, tiny_qwen) -> None:
    """``/v1/completions`` and ``/v1/chat/completions`` carry each choice's ``weight_versions``:
    the label of the weights live when it was sampled, as ``/weight_info`` names it."""
    live = requests.get(server + "/weight_info", timeout=60).json()["weight_version"]
    model = str(tiny_qwen)
    out = requests.post(server + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "1+2=", "max_tokens": 5, "ignore_eos": True, "n": 2, "seed": 0}).json()
    assert [c["weight_versions"] for c in out["choices"]] == [[{"version": live, "start": 0, "end": 5}]] * 2, out
    chat = requests.post(server + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 4, "ignore_eos": True,
        "chat_template": CHAT_TEMPLATE}).json()
    assert "choices" in chat, chat
    assert chat["choices"][0]["weight_versions"] == [{"version": live, "start": 0, "end": 4}], chat
    stops = list(range(0, 256, 6))  # the tiny model samples one of these every few tokens: lengths differ
    finals = _varied_final_chunks(server + "/v1/completions", {
        "model": model, "prompt": ["1+2=", "3+4+5="], "max_tokens": 12, "n": 2, "logprobs": 0,
        "stop_token_ids": stops})
    assert sorted(finals) == [0, 1, 2, 3], finals  # two prompts, two choices each: one final chunk per choice
    for choice, n in finals.values():
        assert choice["weight_versions"] == [{"version": live, "start": 0, "end": n}], (n, choice)
    finals = _varied_final_chunks(server + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 12, "n": 2,
        "logprobs": True, "stop_token_ids": stops, "chat_template": CHAT_TEMPLATE})
    assert sorted(finals) == [0, 1], finals
    for choice, n in finals.values():
        assert choice["weight_versions"] == [{"version": live, "start": 0, "end": n}], (n, choice)


def _varied_final_chunks(url: str, body: dict) -> dict[int, tuple[dict, int]]:
    """``_final_chunks`` of the first seed whose choices streamed different numbers of tokens
    (whatever weights the server has now), so a span given to the wrong choice shows."""
    for seed in range(16):
        finals = _final_chunks(url, {**body, "seed": seed})
        if len({n for _, n in finals.values()}) > 1:
            return finals
    raise AssertionError(f"16 seeds, every choice of each the same length: {finals}")


def _final_chunks(url: str, body: dict) -> dict[int, tuple[dict, int]]:
    """A streamed request's final chunk of each choice (the one with its ``finish_reason``) and the
    number of tokens the choice streamed (its chunks' log-probs), by index; no earlier chunk
    carries spans."""
    finals: dict[int, tuple[dict, int]] = {}
    counts: dict[int, int] = {}
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                lp = choice.get("logprobs") or {}
                counts[choice["index"]] = counts.get(choice["index"], 0) + len(lp.get("tokens") or lp.get("content")
                                                                               or ())
                if choice.get("finish_reason") is None:
                    assert "weight_versions" not in choice, choice
                else:
                    finals[choice["index"]] = (choice, counts[choice["index"]])
    return finals


HARNESS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>\n{% endif %}")
"""A chat template whose renderings of a growing conversation extend each other."""


def _unmerged_chars(tok) -> list[int]:
    """Ids of printable ASCII characters no BPE merge of the tiny tokenizer touches: a reply of
    them detokenizes and tokenizes back to the same ids, so an honest harness never drifts."""
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    merged = {ch for m in model["merges"] for part in (m.split(" ") if isinstance(m, str) else m) for ch in part}
    chars = [c for c in "!#$%&()*+,-./:;=?@[]^_{|}~ABCDEFGHIJKLMNOPQRSTUVWXYZ"
             if c not in merged and c in model["vocab"]]
    assert len(chars) >= 6, chars
    return [model["vocab"][c] for c in chars]


def test_openai_harness_episode_is_one_tagged_sample(server, tiny_qwen, group_port) -> None:
    """An agent harness on the ``openai`` SDK, changed only in its http client
    (``ChatTranscript.http_client``), plays 3 turns on ``/v1/chat/completions``; a trainer commits
    a new version between turns. The transcript is one sample: the first prompt, each reply
    tagged with the version the server's spans name, and the rendered user turns between them
    masked. A transformers replay of each reply at its version matches the behaviour log-probs
    (a replay one version off does not). A harness that edits an earlier reply is refused at
    its next call, HTTP 400 naming the turn and the position; so are streaming and n > 1."""
    import openai
    from transformers import AutoTokenizer
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from inflight.trainer.rollout.chat_transcript import ChatTranscript

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen))
    allowed = _unmerged_chars(tok)
    base = load_file(str(tiny_qwen / "model.safetensors"))
    states = {}
    info = InflightTrainerInitInfo(rank=0, port=group_port, push=PushConfig(dtype="float32"), timeout_s=60.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server), source=base)
    transcript, edited = ChatTranscript("harness"), ChatTranscript("editor")
    chat = openai.OpenAI(base_url=server + "/v1", api_key="-", http_client=transcript.http_client())
    editor = openai.OpenAI(base_url=server + "/v1", api_key="-", http_client=edited.http_client())
    ask = {"model": str(tiny_qwen), "max_tokens": 6, "temperature": 1.0,
           "extra_body": {"chat_template": HARNESS_TEMPLATE, "allowed_token_ids": allowed, "ignore_eos": True}}
    messages = [{"role": "user", "content": "count the cats"}]
    try:
        trainer.send_weights()  # the base weights: what each turn is sampled by is known
        for turn in range(3):
            states[trainer.version] = trainer.source
            reply = chat.chat.completions.create(messages=messages, seed=turn, **ask).choices[0].message.content
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and now {turn}"}]
            trainer.source = perturbed(base, seed=400 + turn, scale=0.02)
            trainer.send_weights()
        first = editor.chat.completions.create(messages=messages[:1], seed=9, **ask).choices[0].message.content
        changed = first[:-1] + ("#" if first[-1] != "#" else "%")
        with pytest.raises(openai.BadRequestError, match="re-tokenization drift at turn 1") as drift:
            editor.chat.completions.create(messages=[*messages[:1], {"role": "assistant", "content": changed},
                                                     messages[2]], seed=10, **ask)
        for refused, why in (({"stream": True}, "stream=True"), ({"n": 2}, "n=2")):
            client = openai.OpenAI(base_url=server + "/v1", api_key="-", http_client=ChatTranscript().http_client())
            with pytest.raises(openai.BadRequestError, match=why):
                client.chat.completions.create(messages=messages[:1], **ask, **refused)
    finally:
        trainer.shutdown()
    p0 = edited.calls[0]
    assert f"position {len(p0.prompt_ids) + len(p0.reply.token_ids) - 1} of " in str(drift.value), drift.value
    assert edited.failure and len(edited.calls) == 1
    with pytest.raises(ValueError, match="editor failed, no sample: .*re-tokenization drift"):
        edited.sample(sample_id="e-0", group_id="e", reward=0.0)

    sample = transcript.sample(sample_id="h-0", group_id="h", reward=1.0)
    calls = transcript.calls
    render = lambda msgs: tok.encode(__import__("jinja2").Template(HARNESS_TEMPLATE).render(  # noqa: E731
        messages=msgs, add_generation_prompt=True))
    assert sample.prompt_ids == calls[0].prompt_ids == render(messages[:1])
    observed = [tok.encode(f"\n<user>\nand now {t}\n<assistant>\n") for t in range(2)]
    assert sample.token_ids == calls[0].reply.token_ids + observed[0] + calls[1].reply.token_ids + observed[1] \
        + calls[2].reply.token_ids
    assert sample.observation == [False] * 6 + [True] * len(observed[0]) + [False] * 6 + [True] * len(observed[1]) \
        + [False] * 6
    versions = sorted(states)
    assert [set(c.reply.versions) for c in calls] == [{v} for v in versions], [c.reply.labels for c in calls]
    assert sample.versions[6:6 + len(observed[0])] == [versions[0]] * len(observed[0])
    ref, mask = Reference(tiny_qwen, "float32"), torch.full((len(tok),), float("-inf"), dtype=torch.float64)
    mask[allowed] = 0.0

    def replayed(call, version: int) -> torch.Tensor:
        ref.load(states[version])
        with torch.no_grad():
            logits = ref.model(torch.tensor([call.prompt_ids + call.reply.token_ids])).logits[0].double()
        rows = logits[len(call.prompt_ids) - 1:-1] + mask
        return torch.log_softmax(rows, -1).gather(-1, torch.tensor(call.reply.token_ids)[:, None])[:, 0]
    for k, call in enumerate(calls):
        got = torch.tensor(call.reply.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, replayed(call, versions[k]), atol=1e-4, rtol=0)
        other = versions[k - 1] if k else versions[1]
        assert (got - replayed(call, other)).abs().max() > 1e-3, k


def _replay_sample(ref, states: dict, sample, mask: torch.Tensor, shift: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Each reply of ``sample`` (a run of tokens not observed) as (behaviour log-probs, a
    transformers replay over the whole context under the version its tags name, ``shift``
    versions on)."""
    out, tokens, k = [], sample.token_ids, 0
    order = sorted(states)
    while k < len(tokens):
        if sample.observation and sample.observation[k]:
            k += 1
            continue
        end = k
        while end < len(tokens) and not (sample.observation and sample.observation[end]):
            end += 1
        version = order[(order.index(sample.versions[k]) + shift) % len(order)]
        assert set(sample.versions[k:end]) == {sample.versions[k]}, sample.versions[k:end]
        ref.load(states[version])
        context = sample.prompt_ids + tokens[:end]
        with torch.no_grad():
            logits = ref.model(torch.tensor([context])).logits[0].double()
        rows = logits[len(sample.prompt_ids) + k - 1:len(context) - 1] + mask
        got = torch.log_softmax(rows, -1).gather(-1, torch.tensor(tokens[k:end])[:, None])[:, 0]
        out.append((torch.tensor(sample.logprobs[k:end], dtype=torch.float64), got))
        k = end
    return out


def test_verifiers_own_harness_over_the_server(server, tiny_qwen, group_port) -> None:
    """A verifiers environment runs with its own harness (``tests.vf_two_turn_harness``: the
    ``openai`` SDK against verifiers' interception server), its model calls made by verifiers'
    own clients against the engine's server: ``TrainClient`` (renderers, ``/inference/v1/generate``)
    and ``EvalClient`` (``/v1/chat/completions``). A trainer commits a version between the two
    turns. Each episode is one sample: both replies tagged with the version that sampled them,
    the user turn between them masked, the rubric's reward; a transformers replay of each reply
    under its tags matches the behaviour log-probs within 1e-4, and under the tags shifted by
    one version does not."""
    import asyncio

    import verifiers.v1 as vf
    from transformers import AutoTokenizer
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import tests.vf_two_turn_harness as harness
    from inflight.trainer.envs.verifiers_env import plugin_id
    from inflight.trainer.rollout.verifiers_server import ServerEpisodes

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen))
    allowed = _unmerged_chars(tok)
    base = load_file(str(tiny_qwen / "model.safetensors"))
    info = InflightTrainerInitInfo(rank=0, port=group_port, push=PushConfig(dtype="float32"), timeout_s=60.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server), source=base)
    env = vf.load_environment(vf.resolve_env_config({
        "taskset": {"id": plugin_id("tests.vf_two_turn_env")},
        "agent": {"harness": {"id": plugin_id("tests.vf_two_turn_harness")}, "runtime": {"type": "subprocess"}}}))
    sampling = vf.SamplingConfig(max_tokens=6, temperature=1.0, allowed_token_ids=allowed, ignore_eos=True,
                                 chat_template=HARNESS_TEMPLATE)
    clients = {"train": vf.TrainClientConfig(base_url=server + "/v1",
                                             renderer={"name": "default", "chat_template": HARNESS_TEMPLATE}),
               "eval": vf.EvalClientConfig(base_url=server + "/v1")}
    states: dict[int, dict] = {}

    def commit() -> None:
        trainer.source = perturbed(base, seed=500 + len(states), scale=0.02)
        trainer.send_weights()
        states[trainer.version] = trainer.source

    async def episodes() -> dict:
        async with env.serving():
            return {name: await ServerEpisodes(env, vf.ModelContext(model=str(tiny_qwen), client=client,
                                                                    sampling=sampling), "tests.vf_two_turn_env")
                    .run(list(env.taskset)[0], group_id=name, sample_id=f"{name}-0")
                    for name, client in clients.items()}
    try:
        trainer.send_weights()  # the base weights: what each turn is sampled by is known
        states[trainer.version] = base
        harness.between_turns = commit
        samples = asyncio.run(episodes())
    finally:
        harness.between_turns = None
        trainer.shutdown()
    mask = torch.full((len(tok),), float("-inf"), dtype=torch.float64)
    mask[allowed] = 0.0
    ref = Reference(tiny_qwen, "float32")
    for name, (sample,) in samples.items():
        observed = tok.encode("\n<user>\nand now 0\n<assistant>\n")
        assert sample.reward == 1.0 and sample.prompt_ids == tok.encode(HARNESS_TEMPLATE.replace(
            "{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}", "<user>\ncount the cats\n")
            .replace("{% if add_generation_prompt %}<assistant>\n{% endif %}", "<assistant>\n")), (name, sample)
        assert sample.observation == [False] * 6 + [True] * len(observed) + [False] * 6, (name, sample.observation)
        assert sample.token_ids[6:6 + len(observed)] == observed, name
        first, second = sample.versions[0], sample.versions[-1]
        assert second == first + 1 and sample.versions[:6] == [first] * 6, (name, sample.versions)
        for got, replayed in _replay_sample(ref, states, sample, mask):
            torch.testing.assert_close(got, replayed, atol=1e-4, rtol=0)
        assert all((got - wrong).abs().max() > 1e-3 for got, wrong in _replay_sample(ref, states, sample, mask, 1))
