"""Reading a ``TrainConfig``: a packaged config by name, a TOML file, or a dict, with
``--set key.path=value`` overrides; every key checked against the dataclasses
(``inflight.trainer.config``), errors naming the dotted path of the offending key.

    load_config("demo")                                  # trainer/configs/demo.toml
    load_config("my_run.toml", ["run.steps=5", "optim.lr=3e-4"])

A name has no '/' and no ``.toml`` suffix and is looked up as ``<name>.toml`` in the configs
that ship inside the package (``trainer/configs/``); anything else is a path to a file.

A config file's own relative paths are read from the file's directory, wherever the run
starts: a dataset (``task.jsonl.path``, ``eval_path``) and a model directory (``model.path``,
when that directory exists there) next to the config, and a task module (``task.name =
"my_task:make"``) next to it is importable (the directory joins ``sys.path``, which spawned
engines inherit). ``--set`` values are the shell's: relative to the working directory, as
is ``run.out_dir``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import tomllib
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from inflight.trainer.config import TrainConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""The packaged configs (package data: they travel in the wheel)."""

# TOML's scalar types a field of each annotation accepts; bool is an int to Python, not to a config
_SCALARS: dict[Any, tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}


def _check_scalar(hint: Any, value: Any, where: str) -> None:
    accepted = _SCALARS.get(hint)
    if accepted is None:
        return  # Literal choices, tuples, optionals: each dataclass checks its own
    if not isinstance(value, accepted) or (hint is not bool and isinstance(value, bool)):
        raise ValueError(f"{where}={value!r}: expected {hint.__name__}")


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where or 'config'}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = f"{where}.{key}" if where else key
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ValueError(f"{sub}: expected a table, got {value!r}")
            kwargs[key] = _build(hint, value, sub)
        else:
            _check_scalar(hint, value, sub)
            # only a list becomes a tuple: a bare string stays one, for the field to name it
            kwargs[key] = tuple(value) if typing.get_origin(hint) is tuple and isinstance(value, list) else value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where or 'config'}: {e}") from None


def config_names() -> list[str]:
    """The packaged configs, by the name ``--config`` takes."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def find_config(path_or_name: str | Path) -> Path:
    """The file behind ``--config``: a packaged config by name, or a path (a ``Path`` always is one)."""
    text = str(path_or_name)
    if isinstance(path_or_name, Path) or "/" in text or text.endswith(".toml"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"config {text!r}: no such file")
        return path
    path = CONFIG_DIR / f"{text}.toml"
    if not path.is_file():
        raise FileNotFoundError(f"config {text!r}: no packaged config of that name; packaged: "
                                f"{', '.join(config_names())} (a path to a file has a '/' or ends in .toml)")
    return path


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` -> ``(["optim", "lr"], 0.0003)``: the value in TOML syntax, else a bare string."""
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ValueError(f"--set {text!r}: expected KEY.PATH=VALUE, e.g. run.steps=5")
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return path, raw  # run.out_dir=/tmp/x, transport.host=10.0.0.2: no quotes needed
    if list(parsed) != ["v"]:  # "1\nw = 2": one value, not a document
        return path, raw
    return path, parsed["v"]


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """``data`` with each ``key.path=value`` set, tables created on the way; later ones win.

    Applied to the raw tables before validation, so a bad key or value is reported exactly as
    it would be from the file."""
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        table = data
        for i, part in enumerate(path[:-1]):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ValueError(f"--set {text!r}: {'.'.join(path[:i + 1])}={table!r} is a value, not a table")
        table[path[-1]] = value
    return data


def load_config(path_or_name: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
    """Read a packaged config or a TOML file into a ``TrainConfig``, overrides applied."""
    path = find_config(path_or_name)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from None
    if path.parent != CONFIG_DIR:
        data = _next_to(path.parent.resolve(), data)
        data.setdefault("run", {}).setdefault("name", path.stem)  # its outputs: runs/<the file's name>
    return _build(TrainConfig, apply_overrides(data, overrides), "")


def _next_to(base: Path, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config file's) with its relative data paths made absolute from ``base``, the
    file's directory, which also becomes importable for a task module there."""
    data = copy.deepcopy(data)
    jsonl = data.get("task", {}).get("jsonl", {})
    for key in ("path", "eval_path"):
        if isinstance(jsonl.get(key), str) and jsonl[key] and not Path(jsonl[key]).expanduser().is_absolute():
            jsonl[key] = str(base / jsonl[key])
    model = data.get("model", {})
    if isinstance(model.get("path"), str) and model["path"] and (base / model["path"]).is_dir():
        model["path"] = str(base / model["path"])
    dataset = data.get("task", {}).get("dataset", {})  # a local directory or file; else a hub id
    if isinstance(dataset.get("path"), str) and dataset["path"] and (base / dataset["path"]).exists():
        dataset["path"] = str(base / dataset["path"])
    if str(base) not in sys.path:
        sys.path.append(str(base))
    return data


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    return _build(TrainConfig, data, "")


def add_config_arguments(ap: argparse.ArgumentParser) -> None:
    """``--config`` and ``--set``, as ``inflight train`` and ``inflight engine`` take them."""
    ap.add_argument("--config", required=True, metavar="NAME|PATH",
                    help=f"a packaged config ({', '.join(config_names())}) or a TOML file (a path has a '/' "
                         "or ends in .toml)")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                    help="override one setting of the config, the value in TOML syntax (run.steps=5, optim.lr=3e-4, "
                         "optim.betas=[0.9,0.95]; anything else is a string); repeatable, later ones win")


config_to_dict = dataclasses.asdict
