"""``dataset``: prompts and reference answers from a Hugging Face ``datasets`` dataset.

``[task.dataset]`` names it the way ``datasets`` does: ``path`` is a hub id (``openai/gsm8k``,
with ``subset = "main"``), a directory written by ``Dataset.save_to_disk``, or a data file
(``.json``, ``.jsonl``, ``.csv``, ``.parquet``); ``split`` the training split and
``eval_split`` the held-out one (empty: the last ``eval.prompts`` rows of ``split``). Each row
becomes a record as in the ``jsonl`` task (``inflight.trainer.envs.jsonl``): ``prompt_field`` (or
``messages_field``, a list of ``{"role", "content"}``) and ``answer_field``; the other
columns travel in ``Prompt.meta``. The reward is the ``jsonl`` task's: ``match`` (the final
number, GSM8K's ``#### N`` style, or an exact match) or a ``reward`` function.

A row that is not such a record fails the load naming the dataset, the split, the row and
the column, before any engine starts (the trainer builds the task first). The trainer loads
the dataset first; engines on the same machine read it from ``datasets``' cache. Install
with ``pip install 'inflight[datasets]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inflight.trainer.envs.jsonl import Match, RecordsTask, to_prompt
from inflight.trainer.tasks.task import Prompt

DATA_FILES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
"""Data-file suffixes ``path`` may name, and the ``datasets`` builder that reads each."""


def _load_split(path: str, subset: str, split: str) -> Any:
    """One split of the dataset ``path`` names (see the module docstring)."""
    try:
        import datasets
    except ImportError:
        raise ImportError("task.name = 'dataset' needs the datasets package: pip install "
                          "'inflight[datasets]'") from None
    local = Path(path).expanduser()
    if local.is_dir() and ((local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(local))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{path}: no split {split!r} (it has {sorted(loaded)})")
            return loaded[split]
        return loaded  # one Dataset saved alone: it is every split asked for
    if local.is_file():
        builder = DATA_FILES.get(local.suffix)
        if builder is None:
            raise ValueError(f"{path}: a data file must end in one of {sorted(DATA_FILES)}")
        return datasets.load_dataset(builder, data_files=str(local), split="train")
    if path.startswith(("/", ".", "~")) or local.suffix in DATA_FILES:
        raise ValueError(f"task.dataset.path={path!r}: no such file or directory")
    return datasets.load_dataset(path, subset or None, split=split)  # a hub id


def load_rows(cfg: Any, split: str, check: str) -> list[Prompt]:
    """The rows of ``split`` (``cfg``: the ``[task.dataset]`` table), as prompts."""
    rows = _load_split(cfg.path, cfg.subset, split)
    text_field = cfg.messages_field or cfg.prompt_field
    source = f"{cfg.path}[{split}]"
    for key, column in (("messages_field" if cfg.messages_field else "prompt_field", text_field),
                        ("answer_field", cfg.answer_field)):
        if column not in rows.column_names:
            raise ValueError(f"{source}: no column {column!r} (columns: {rows.column_names}); set task.dataset.{key}")
    if cfg.max_rows:
        rows = rows.select(range(min(cfg.max_rows, len(rows))))
    key = "messages" if cfg.messages_field else "prompt"
    prompts = []
    for i, row in enumerate(rows):
        record = {k: v for k, v in row.items() if k not in (text_field, cfg.answer_field)}
        record.update({key: row[text_field], "answer": row[cfg.answer_field]})
        prompts.append(to_prompt(record, f"{source} row {i}", check))
    if not prompts:
        raise ValueError(f"{source}: no rows")
    return prompts


class DatasetTask(RecordsTask):
    """Prompts and answers from a Hugging Face dataset (see the module docstring)."""

    def __init__(self, cfg: Any, *, eval_size: int = 0) -> None:
        match: Match = cfg.match
        super().__init__(match=match, reward=cfg.reward, where="task.dataset")
        records = load_rows(cfg, cfg.split, self.check)
        if cfg.eval_split:
            self.train, self.held_out = records, load_rows(cfg, cfg.eval_split, self.check)
        else:
            self.hold_out(records, eval_size, f"task.dataset: {cfg.path}[{cfg.split}]", "task.dataset.eval_split")
