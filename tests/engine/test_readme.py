"""The README's scripts run as written: the "Using the worker" engine and trainer processes (the
trainer's push committed while the engine samples, the engine's tokens then tagged with the
pushed version), and the RL API recipe (the server command, a trainer on vLLM's own client, the
curl that reads version spans)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _scripts() -> dict[str, str]:
    """The README's python blocks whose first line names a file (``# my_engine.py: ...``)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return {m.group(1): b for b in blocks if (m := re.match(r"# (\w+\.py):", b))}


def test_the_readme_worker_scripts_run_as_written(tmp_path) -> None:
    scripts = _scripts()
    assert set(scripts) >= {"my_engine.py", "my_trainer.py"}, list(scripts)
    for name in ("my_engine.py", "my_trainer.py"):
        (tmp_path / name).write_text(scripts[name])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as a user runs it: vLLM's defaults
    run = {name: subprocess.Popen([sys.executable, name], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for name in ("my_trainer.py", "my_engine.py")}
    out = {}
    for name, proc in run.items():
        out[name] = proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, (name, out[name][-3000:])
    assert re.search(r"v1 committed at engine step \d+ tokens per request then: ",
                     out["my_trainer.py"]), out["my_trainer.py"]
    versions = re.search(r"versions \[([\d, ]+)\]", out["my_engine.py"])
    assert versions and versions.group(1).split(", ")[-1] == "1", out["my_engine.py"][-2000:]


def _shell_blocks() -> dict[str, str]:
    """The README's bash blocks whose first line names a script (``# serve.sh: ...``)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return {m.group(1): b for b in blocks if (m := re.match(r"# ([\w.]+\.sh):", b))}


def test_the_readme_rl_api_recipe_runs_as_written(tmp_path) -> None:
    """The server command, the trainer written for vLLM's RL API and the curl, as the README
    shows them: the trainer's v1 commits while the server runs, and the curl's tokens carry it."""
    import time
    import urllib.request

    shells, scripts = _shell_blocks(), _scripts()
    assert {"serve.sh", "generate.sh"} <= set(shells) and "my_rl_trainer.py" in scripts, (list(shells), list(scripts))
    for name, text in [*shells.items(), ("my_rl_trainer.py", scripts["my_rl_trainer.py"])]:
        (tmp_path / name).write_text(text)
    bin_dir = str(Path(sys.executable).parent)  # `python` and `inflight` as the user's environment has them
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(name, None)  # as a user runs it: vLLM's defaults and the command's own settings
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(["bash", "serve.sh"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 900  # start-up only: a bound for a hang, never a check of speed
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=10):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (
                    (tmp_path / "serve.log").read_text()[-3000:])
                time.sleep(1.0)
        trainer = subprocess.run([sys.executable, "my_rl_trainer.py"], cwd=tmp_path, env=env, capture_output=True,
                                 text=True, timeout=900)
        assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-3000:]
        assert re.search(r"v1 committed at engine step \d+", trainer.stdout), trainer.stdout
        curl = subprocess.run(["bash", "generate.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert curl.returncode == 0, curl.stderr
        generated, end = json.JSONDecoder().raw_decode(curl.stdout)
        choice = generated["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == 8
        assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": 8}], choice
        final = curl.stdout[end:].strip()  # the streamed completion's one chunk with spans: its last
        assert final.startswith("data: ") and "\n" not in final, curl.stdout
        streamed = json.loads(final[len("data: "):])["choices"][0]
        assert streamed["finish_reason"] == "length", streamed
        assert streamed["weight_versions"] == [{"version": "1", "start": 0, "end": 8}], streamed
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
        log.close()
