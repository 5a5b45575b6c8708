"""The ``inflight`` command and its configs: packaged configs found by name, ``--set`` overrides
validated like the file (errors name the dotted key), and each subcommand's dispatch."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from inflight.trainer import cli
from inflight.trainer.config_files import CONFIG_DIR, config_names, find_config, load_config, parse_override

ROOT = Path(__file__).resolve().parents[2]
PACKAGED = ["demo", "fleet_cpu", "gpu_hf_model", "smollm2_calculator_cpu", "smollm2_calculator_native_cpu",
            "smollm2_cpu", "smollm2_guess_cpu", "smollm2_leg_counting_cpu", "smollm2_lora_cpu",
            "smollm2_reasoning_gym_cpu"]


def test_packaged_configs_are_found_by_name_and_all_load() -> None:
    assert config_names() == PACKAGED
    assert find_config("demo") == CONFIG_DIR / "demo.toml"
    for name in config_names():
        load_config(name)


def test_a_path_still_works(tmp_path: Path) -> None:
    """A value with a '/' or a .toml suffix is a path, whatever packaged config shares its stem."""
    text = (CONFIG_DIR / "demo.toml").read_text().replace("steps = 200", "steps = 7")
    (tmp_path / "demo.toml").write_text(text)
    (tmp_path / "no_suffix").write_text(text)
    assert load_config(tmp_path / "demo.toml").run.steps == 7
    assert load_config(str(tmp_path / "no_suffix")).run.steps == 7
    with pytest.raises(FileNotFoundError, match=r"config 'missing/x.toml': no such file"):
        find_config("missing/x.toml")


def test_an_unknown_name_lists_the_packaged_ones() -> None:
    with pytest.raises(FileNotFoundError, match=r"config 'dmeo': no packaged config of that name; packaged: "
                                                 r"demo, fleet_cpu, gpu_hf_model, smollm2_calculator_cpu, "
                                                 r"smollm2_calculator_native_cpu, smollm2_cpu, smollm2_guess_cpu, "
                                                 r"smollm2_leg_counting_cpu, smollm2_lora_cpu, "
                                                 r"smollm2_reasoning_gym_cpu"):
        find_config("dmeo")


@pytest.mark.parametrize(("text", "key", "value"), [
    ("run.steps=5", ["run", "steps"], 5),
    ("optim.lr=3e-4", ["optim", "lr"], 3e-4),
    ("run.resume=true", ["run", "resume"], True),
    ("optim.betas=[0.8, 0.9]", ["optim", "betas"], [0.8, 0.9]),
    ("run.name=my run", ["run", "name"], "my run"),  # not TOML: a bare string
    ('run.name="5"', ["run", "name"], "5"),  # quoted: a string that reads as a number
    ("run.out_dir=/tmp/x=y", ["run", "out_dir"], "/tmp/x=y"),  # the first '=' splits
    ("transport.host=10.0.0.2", ["transport", "host"], "10.0.0.2"),
    ("run.name=1\nrun = 2", ["run", "name"], "1\nrun = 2"),  # one value, never a document
])
def test_override_values_read_as_toml(text: str, key: list[str], value: object) -> None:
    assert parse_override(text) == (key, value)


@pytest.mark.parametrize("text", ["run.steps", "=5", "run..steps=5", ".steps=5"])
def test_a_malformed_override_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected KEY.PATH=VALUE"):
        parse_override(text)


def test_overrides_apply_over_the_file_and_later_ones_win() -> None:
    cfg = load_config("demo", ["run.steps=5", "optim.lr=3e-4", "run.steps=6", "eval.every=3", "run.out_dir=/tmp/x"])
    base = load_config("demo")
    assert (cfg.run.steps, cfg.optim.lr, cfg.eval.every, cfg.run.out_dir) == (6, 3e-4, 3, "/tmp/x")
    assert cfg.rollout == base.rollout and cfg.model == base.model  # nothing else moved
    assert load_config("demo", ["optim.betas=[0.8, 0.9]"]).optim.betas == (0.8, 0.9)  # a list becomes the tuple held


@pytest.mark.parametrize(("override", "error"), [
    ("run.stepz=5", r"run: unknown key\(s\) \['stepz'\]"),
    ("runn.steps=5", r"config: unknown key\(s\) \['runn'\]"),
    ("run.steps=five", r"run.steps='five': expected int"),
    ("run.steps=5.0", r"run.steps=5.0: expected int"),
    ("run.resume=1", r"run.resume=1: expected bool"),
    ("run.steps=0", r"run.steps=0 must be >= 1"),
    ("run=5", r"run: expected a table, got 5"),
    ("run.steps.x=1", r"--set 'run.steps.x=1': run.steps=200 is a value, not a table"),
])
def test_override_errors_name_the_key(override: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_config("demo", [override])


def test_an_override_fails_exactly_as_the_same_key_in_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text((CONFIG_DIR / "demo.toml").read_text().replace("steps = 200", "steps = 200\nstepz = 5"))
    with pytest.raises(ValueError, match=r"run: unknown key\(s\) \['stepz'\]") as from_file:
        load_config(bad)
    with pytest.raises(ValueError, match=r"run: unknown key\(s\) \['stepz'\]") as from_set:
        load_config("demo", ["run.stepz=5"])
    assert str(from_file.value) == str(from_set.value)


def test_inflight_help_names_every_command_without_importing_torch() -> None:
    """Through the interpreter, as the console script runs it: torch takes seconds to import."""
    out = subprocess.run([sys.executable, "-m", "inflight.trainer.cli", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in cli.COMMANDS:
        assert name in out.stdout
    probe = ("import sys\nimport inflight.trainer.cli\ntry:\n    inflight.trainer.cli.main(['--help'])\n"
             "except SystemExit:\n    pass\n"
             "print('torch imported:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("torch imported: False"), out.stdout + out.stderr


USAGE_ERROR = "^2$"
"""What a ``SystemExit`` of argparse's usage error says: its exit code (the message goes to stderr)."""


def test_train_and_engine_report_a_bad_config_as_a_usage_error(capfd: pytest.CaptureFixture[str]) -> None:
    """``inflight train``'s error comes from its trainer, a child process (``supervisor``): read from
    the file descriptor, which the child shares."""
    with pytest.raises(SystemExit, match=USAGE_ERROR) as exit_:
        cli.main(["train", "--config", "nope"])
    assert exit_.value.code == 2
    assert ("inflight train: error: config 'nope': no packaged config of that name; packaged: demo"
            in capfd.readouterr().err)
    with pytest.raises(SystemExit, match=USAGE_ERROR):
        cli.main(["train", "--config", "demo", "--set", "run.stepz=5"])
    assert "inflight train: error: run: unknown key(s) ['stepz']" in capfd.readouterr().err
    with pytest.raises(SystemExit, match=USAGE_ERROR):
        cli.main(["engine", "--config", "demo", "--set", "run.steps=0", "--model-dir", "x", "--port", "1"])
    assert "inflight engine: error: run: run.steps=0 must be >= 1" in capfd.readouterr().err


def test_prepare_model_prints_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    cli.main(["prepare-model", str(tmp_path)])
    assert capsys.readouterr().out.strip() == str(tmp_path)
    with pytest.raises(SystemExit, match=USAGE_ERROR):
        cli.main(["prepare-model", str(tmp_path / "absent")])
    assert "no such directory" in capsys.readouterr().err


def test_bench_runs_the_module_with_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "inflight.trainer.cli", "bench", "transport", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: transport.py") and "--bucket-mb" in out.stdout
    with pytest.raises(SystemExit, match=USAGE_ERROR) as exit_:
        cli.main(["bench", "nope"])
    assert exit_.value.code == 2 and "argument NAME: invalid choice: 'nope'" in capsys.readouterr().err


def test_bench_lists_every_benchmark_program() -> None:
    """Every bench module with a ``__main__`` block, and nothing else."""
    programs = set()
    for path in (ROOT / "bench").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                programs.add(path.stem)
    assert set(cli.BENCHES) == programs


def test_the_console_script_and_its_data_are_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["inflight"] == "inflight.trainer.cli:main"
    data = project["tool"]["setuptools"]["package-data"]
    assert "configs/*.toml" in data["inflight.trainer"] and "scenarios/*.toml" in data["inflight.bench"]


def test_the_configuration_reference_is_generated_from_the_code() -> None:
    """docs/configuration.md is ``python -m inflight.trainer.config_docs``'s output: every key of every
    table, with its default and docstring (regenerate it when a setting changes)."""
    from inflight.trainer.config_docs import render, tables

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert doc == render(), ("docs/configuration.md is stale: python -m inflight.trainer.config_docs > "
                             "docs/configuration.md")
    keys = {f"{name}.{key}" for name, _, rows in tables() for key, _, _ in rows}
    assert {"run.resume", "optim.micro_batch_tokens", "optim.packing", "optim.warmup_steps", "task.episode.max_turns",
            "task.guess_number.consistency_credit", "engine.kv_cache_gb"} <= keys
    assert all(meaning for _, _, rows in tables() for _, _, meaning in rows)  # every key has its docstring
