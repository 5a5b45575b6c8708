"""The README's "Using the worker" scripts run as written: an engine and a trainer process on
one machine, the trainer's push committed while the engine samples, the engine's tokens then
tagged with the pushed version."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    assert re.search(r"v1 committed at engine step \d+ tokens per request then: ", out["my_trainer.py"]), out["my_trainer.py"]
    versions = re.search(r"versions \[([\d, ]+)\]", out["my_engine.py"])
    assert versions and versions.group(1).split(", ")[-1] == "1", out["my_engine.py"][-2000:]
