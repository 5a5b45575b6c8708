"""Reading a ``TrainConfig``: a TOML file or a dict, every key checked against the dataclasses
(``trainer.config``), errors naming the dotted path of the offending key."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig


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
            kwargs[key] = tuple(value) if typing.get_origin(hint) is tuple else value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where or 'config'}: {e}") from None


def load_config(path: str | Path) -> TrainConfig:
    """Read a TOML file into a ``TrainConfig``."""
    with open(path, "rb") as f:
        return _build(TrainConfig, tomllib.load(f), "")


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    return _build(TrainConfig, data, "")


config_to_dict = dataclasses.asdict
