"""Other ecosystems' environments as tasks: an OpenEnv server (``task.name = "openenv"``, driven through
openenv-core's client) and skyrl-gym environments (``task.name = "skyrl_gym"``, ``skyrl_gym.make``).

``tests.ecosystem_envs`` holds one environment of each, written against its package's public API: a
two-turn digit game whose rewards differ episode to episode under a tiny random policy. The OpenEnv one runs
as its own uvicorn server on loopback, as any OpenEnv server would.

- skyrl-gym's shipped ``gsm8k`` and ``gsm8k_multi_turn``: hand-written episodes through the task earn what
  skyrl-gym's own loop (make, init, step until done, rewards summed) gives them; a replay that differs fails.
- Bad settings (an environment id skyrl-gym does not register, a URL where no OpenEnv server answers, an
  action field the server's schema lacks) stop the build naming the setting and the value.
- ``inflight train`` trains 5 steps on each: every episode took the environment's two turns, every token is
  tagged, the environment's tokens are out of the loss, and each trained sample's reward is what the
  environment returns when its replies, as sampled, are played again directly against it (an OpenEnv
  session of the episode's seed; a skyrl-gym env of its row).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import RUN_BASE, WAIT_S, check_tags, free_port, metrics_rows, run_config, wait_until

pytest.importorskip("openenv")
pytest.importorskip("skyrl_gym")

ROOT = Path(__file__).parents[2]
COUNT = "tests.ecosystem_envs:CountDigits"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The digit game's OpenEnv server (``uvicorn tests.ecosystem_envs:app``) on a loopback port: its URL."""
    import httpx

    port, log = free_port(), tmp_path_factory.mktemp("openenv") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.ecosystem_envs:app", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning"], cwd=ROOT, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"the OpenEnv server exited: {log.read_text()[-2000:]}"
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_until(up, "the OpenEnv server to answer /health", poll_s=0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _play(task, prompt, replies: list[str]) -> tuple[float, list[str]]:
    """An episode of ``replies`` through the task's ``turn``, as the rollout asks it: (reward, observations)."""
    from inflight.trainer.tasks import EpisodeView

    observations: list[str] = []
    for i in range(len(replies)):
        out = task.turn(EpisodeView(prompt=prompt, replies=tuple(replies[:i + 1]), observations=tuple(observations),
                                    last=i == len(replies) - 1))
        out = asyncio.run(out) if asyncio.iscoroutine(out) else out
        if out.done:
            return out.reward, observations
        observations.append("\n".join(m["content"] for m in out.messages) if out.messages else out.observation)
    raise AssertionError("the episode never ended")


def _skyrl_reference(row: dict, replies: list[str]) -> tuple[float, int]:
    """skyrl-gym's own episode: make, init, step each reply until done; (rewards summed, steps taken)."""
    import skyrl_gym
    from omegaconf import OmegaConf

    from inflight.trainer.envs.skyrl_gym_env import check_env

    check_env(row["env_class"], "env_class")  # an entry point is registered by its first use
    env = skyrl_gym.make(row["env_class"], env_config=OmegaConf.create({}), extras=row)
    env.init(row["prompt"])
    total, steps = 0.0, 0
    for reply in replies:
        out = env.step(reply)
        total, steps = total + out["reward"], steps + 1
        if out["done"]:
            break
    return total, steps


GSM = [{"prompt": [{"role": "user", "content": "Ana has 13 apples and buys 4. How many?"}], "env_class": env,
        "reward_spec": {"method": "rule", "ground_truth": "17"}, "extra_info": {"max_turns": 3}}
       for env in ("gsm8k_multi_turn", "gsm8k")]


@pytest.mark.parametrize("replies", [["#### 17"], ["so 16", "#### 16", "#### 17"], ["#### 1,7", "17", "x"],
                                     ["#### 16", "#### 17", "#### 17"]])
def test_skyrl_gym_shipped_envs_reward_an_episode_as_skyrl_gym_does(tmp_path, replies) -> None:
    from inflight.trainer.envs.skyrl_gym_env import SkyRLGymConfig, SkyRLGymTask

    task = SkyRLGymTask(SkyRLGymConfig(env="gsm8k", path=_rows(tmp_path / "gsm.jsonl", GSM)))
    for prompt, row in zip(task.train, GSM, strict=True):
        total, steps = _skyrl_reference(row, replies)
        reward, observations = _play(task, prompt, replies[:steps])
        assert (reward, len(observations)) == (total, steps - 1), (row["env_class"], replies)
    multi = task.train[0]
    # a replay that does not give the episode's observations is refused, named
    from inflight.trainer.tasks import EpisodeView

    with pytest.raises(ValueError, match="gsm8k_multi_turn.*replaying reply 0.*not deterministic"):
        task.turn(EpisodeView(prompt=multi, replies=("so 16", "#### 17"), observations=("something else",)))


@pytest.mark.parametrize(("table", "named"), [
    ({"env": "gsm8kk"}, "task.skyrl_gym.env='gsm8kk' is not a skyrl-gym environment (did you mean gsm8k"),
    ({"env": "tests.no_such_module:Env"}, "task.skyrl_gym.env='tests.no_such_module:Env': cannot load"),
    ({"path": ""}, "task.skyrl_gym.path is empty"),
    ({"rows": [{"prompt": "x", "env_class": "serch"}]}, "row 0: env_class='serch' is not a skyrl-gym environment"),
    ({"rows": [{"prompt": []}]}, "row 0: 'prompt' must be a non-empty string or list"),
    ({"env": "gsm8k_multi_turn"}, "row 0: skyrl-gym 'gsm8k_multi_turn' refused it (KeyError: 'extra_info')"),
])
def test_a_bad_skyrl_gym_table_stops_the_build_naming_it(tmp_path, table, named) -> None:
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.envs import build_task

    rows = table.pop("rows", [{"prompt": "x", "reward_spec": {"ground_truth": "1"}}])
    section = {"path": _rows(tmp_path / "rows.jsonl", rows), **table}
    cfg = config_from_dict({"task": {"name": "skyrl_gym", "skyrl_gym": section}})
    with pytest.raises(ValueError) as e:
        build_task(cfg, tokenizer=None)
    assert named in str(e.value), e.value


def test_a_bad_openenv_table_stops_the_build_naming_it(server) -> None:
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.envs import build_task

    def build(**table):
        return build_task(config_from_dict({"task": {"name": "openenv", "openenv": table}}), tokenizer=None)

    closed = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"task.openenv.url='{closed}': no OpenEnv server answers"):
        build(url=closed, timeout_s=5)
    assert time.monotonic() - start < WAIT_S  # a bound for a hang, not a speed check
    with pytest.raises(ValueError, match=r"action_field='text' is not a field of the server's action 'DigitAction' "
                                         r"\(its fields: \['message', 'metadata'\]\)"):
        build(url=server, action_field="text")
    with pytest.raises(ValueError, match="task.openenv.url is empty"):
        build()
    assert build(url=server).action_field == "message"  # the schema's one required field


def test_the_documented_tables_build_their_tasks(server, tmp_path) -> None:
    """docs/training.md's ``[task.openenv]`` and ``[task.skyrl_gym]`` blocks, as written but for the
    server's URL and the rows' file: each builds its task, its settings in place."""
    import tomllib

    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.envs import build_task

    text = (ROOT / "docs" / "training.md").read_text()

    def documented(heading: str) -> dict:
        return tomllib.loads(text[text.index(heading + "\n"):].split("```toml\n", 1)[1].split("```", 1)[0])

    doc = documented("### OpenEnv")
    doc["task"]["openenv"]["url"] = server
    task = build_task(config_from_dict(doc), tokenizer=None)
    assert (task.action_field, task.cfg.observation_field) == ("message", "prompt")
    assert task.sample(random.Random(0)).text.startswith("game ")
    doc = documented("### skyrl-gym")
    doc["task"]["skyrl_gym"]["path"] = _rows(tmp_path / "gsm.jsonl", GSM[:1])
    cfg = config_from_dict(doc)
    task = build_task(cfg, tokenizer=None)
    assert cfg.task.episode.max_turns == 5 and task.train[0].meta["row"]["env_class"] == "gsm8k_multi_turn"


def _episodes(out: Path) -> list[tuple[str, float, list[str]]]:
    """Each trained sample of the run in ``out``: its prompt, its reward and its replies (the policy's
    token runs between the observations, decoded), read from the groups the trainer admitted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "init"))
    trained = {g for r in metrics_rows(out) for g in r.get("group_ids", [])}
    found = []
    for group in ADMITTED:
        if group.group_id not in trained:
            continue
        for s in group.samples:
            runs, last = [], None
            for token, env in zip(s.token_ids, s.observation, strict=True):
                if not env:
                    runs.append([token]) if last in (None, True) else runs[-1].append(token)
                last = env
            found.append((s.prompt_text, s.reward, [tok.decode(r, skip_special_tokens=True) for r in runs]))
    return found


ADMITTED: list = []


def _train(tmp_path, monkeypatch, task: dict) -> tuple[dict, list[dict], Path]:
    """5 steps of ``inflight train``'s entry point on ``task`` (a tiny ChatML model), recording the groups
    the trainer admits."""
    from inflight.protocol import decode_group
    from inflight.rollout_queue import RolloutBuffer
    from inflight.trainer.train import train

    admit = RolloutBuffer._admit

    def recording(self, data: bytes, current_version: int) -> None:
        ADMITTED.append(decode_group(data))
        admit(self, data, current_version)
    ADMITTED.clear()
    monkeypatch.setattr(RolloutBuffer, "_admit", recording)
    out = tmp_path / "run"
    cfg = run_config(out, 5, task={**task, "completion_tokens": 8,
                                   "episode": {"max_turns": 3, "max_tokens": 200}},
                     model={"tiny": {**RUN_BASE["model"]["tiny"], "chat": True}},
                     rollout={"group_size": 2, "groups_per_step": 1, "in_flight_groups": 2, "queue_capacity": 2})
    summary = train(cfg)
    rows = [r for r in metrics_rows(out) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    check_tags(summary, rows, cfg.loss.max_lag)
    groups = {g.group_id: g for g in ADMITTED}
    for r in rows:  # the loss saw the policy's tokens of the step's episodes, and none of the environment's
        samples = [s for g in r["group_ids"] for s in groups[g].samples]
        assert all(any(s.observation) for s in samples), r["group_ids"]
        assert r["tokens_in_loss"] == sum(s.observation.count(False) for s in samples), r
    return summary, rows, out


def test_inflight_train_trains_on_an_openenv_server(server, tmp_path, monkeypatch) -> None:
    from openenv import GenericEnvClient

    _, rows, out = _train(tmp_path, monkeypatch, {"name": "openenv", "openenv": {"url": server,
                                                                                "observation_field": "prompt"}})
    episodes = _episodes(out)
    assert len(episodes) == 5 * 2 and all(len(replies) == 2 for _, _, replies in episodes), episodes

    async def direct(seed: int, replies: list[str]) -> float:
        async with GenericEnvClient(base_url=server) as env:
            await env.reset(seed=seed)
            return sum([(await env.step({"message": r})).reward for r in replies])
    for prompt, reward, replies in episodes:
        seed = int(prompt.split("game ", 1)[1].split(":", 1)[0])
        assert reward == asyncio.run(direct(seed, replies)), (prompt, replies)
    assert len({reward for _, reward, _ in episodes}) > 1  # rewards differ: a wrong episode's would show


def test_inflight_train_trains_on_a_skyrl_gym_environment(tmp_path, monkeypatch) -> None:
    rows = [{"prompt": f"Write the digit {d} often.", "reward_spec": {"ground_truth": str(d)}} for d in range(10)]
    task = {"name": "skyrl_gym", "skyrl_gym": {"env": COUNT, "path": _rows(tmp_path / "rows.jsonl", rows)}}
    _, _, out = _train(tmp_path, monkeypatch, task)
    episodes = _episodes(out)
    assert len(episodes) == 5 * 2 and all(len(replies) == 2 for _, _, replies in episodes), episodes
    by_prompt = {f"user: {r['prompt']}": {**r, "env_class": COUNT} for r in rows}
    for prompt, reward, replies in episodes:
        assert (reward, 2) == _skyrl_reference(by_prompt[prompt], replies), (prompt, replies)
    assert len({reward for _, reward, _ in episodes}) > 1
