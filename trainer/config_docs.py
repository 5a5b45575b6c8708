"""docs/configuration.md, generated from the training config's dataclasses: every table and
key, its default and its docstring, so the reference cannot drift from the code.

    python -m inflight.trainer.config_docs > docs/configuration.md

(``tests/unit/test_cli.py`` fails when the file and this output differ.)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import typing
from typing import Any

from inflight.trainer.config import TrainConfig

HEADER = """# Configuration reference

Every key of a training config (`inflight train --config FILE`, `--set KEY.PATH=VALUE`), by
TOML table, with its default and what it does. Generated from the config dataclasses
(`python -m inflight.trainer.config_docs > docs/configuration.md`); a test fails when it drifts from
the code. Each value is checked when the config loads, and an error names the key.
"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls`` (a string right after it)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _toml(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return "`" + json.dumps(value) + "`" if value != "" else '`""`'


def _choices(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args) + ". "
    if typing.get_origin(hint) is tuple and args and typing.get_origin(args[0]) is typing.Literal:
        return "a list of " + ", ".join(f"`{a}`" for a in typing.get_args(args[0])) + ". "
    return ""


def tables(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, type, list[tuple[str, str, str]]]]:
    """(table name, its class, [(key, default, meaning)]) for ``cls`` and every table inside it."""
    hints = typing.get_type_hints(cls, globalns=vars(sys.modules[cls.__module__]))
    docs, rows, nested = field_docs(cls), [], []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            nested += tables(hints[f.name], f"{prefix}{f.name}.")
        else:
            rows.append((f.name, _toml(_default(f)), _choices(hints[f.name]) + docs.get(f.name, "")))
    own = [(prefix.rstrip("."), cls, rows)] if rows else []
    return own + nested


def escape(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe inside a table cell


def render() -> str:
    out = [HEADER]
    for name, cls, rows in tables():
        out.append(f"## [{name}]\n")
        if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
            out.append(" ".join(inspect.cleandoc(cls.__doc__).split()) + "\n")
        out.append("| key | default | meaning |\n| --- | --- | --- |")
        out += [f"| `{key}` | {default} | {escape(meaning)} |" for key, default, meaning in rows]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
