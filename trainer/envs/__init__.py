"""The environments ``inflight`` ships, each written against the task API of
``inflight.trainer.tasks`` as a user's own would be, and ``build_task``, which builds the one
the config names. ``task.name`` in the config picks one:

| name | prompts | reward |
| --- | --- | --- |
| ``repeat_digit`` | ``repeat: D`` | per token: 1 for D, ``digit_credit`` for another digit (the tiny demo) |
| ``arithmetic`` | ``What is 47 + 8? ...`` (``[task.arithmetic]``: digits, terms, ops) | 1 if the final number is right |
| ``jsonl`` | a file of ``{"prompt"|"messages", "answer"}`` (``[task.jsonl]``) | final number (GSM8K ``#### N``) or exact match |
| ``dataset`` | a Hugging Face dataset's prompt and answer columns (``[task.dataset]``) | as ``jsonl``, or your function |
| ``calculator`` | multi-turn: ``What is 47 * 29?`` with a ``calc:`` tool (``[task.calculator]``) | 1 for the right ``answer:``, ``tool_credit`` for a call |
| ``guess_number`` | multi-turn: a secret in [lo, hi], higher/lower feedback (``[task.guess_number]``) | 1 for a win, closeness and consistency credit otherwise |
| ``reasoning_gym`` | a mix of reasoning-gym datasets (``[task.reasoning_gym]``: names, weights, seeds) | the dataset's ``score_answer`` on ``<answer>`` |
| ``openenv`` | multi-turn: an OpenEnv server's episodes, reset by seed (``[task.openenv]``: url, action and observation fields) | the sum of its step rewards |
| ``skyrl_gym`` | multi-turn: a skyrl-gym environment on SkyRL dataset rows (``[task.skyrl_gym]``: env, path, env_config) | the sum of its step rewards |
| ``pkg.module:factory`` | yours: ``factory(tokenizer=..., **task.options)`` returns a ``Task`` | yours |
"""  # noqa: E501

from __future__ import annotations

import dataclasses
from typing import Any

from inflight.trainer.envs.arithmetic import Arithmetic
from inflight.trainer.envs.calculator import Calculator
from inflight.trainer.envs.digits import RepeatDigit
from inflight.trainer.envs.guess_number import GuessNumber
from inflight.trainer.envs.hf_dataset import DatasetTask
from inflight.trainer.envs.jsonl import SAMPLE, JsonlFormatError, JsonlTask, load_jsonl
from inflight.trainer.envs.reasoning_mix import ReasoningGymTask
from inflight.trainer.tasks import Task, load_factory, uses_chat

__all__ = ["SAMPLE", "Arithmetic", "Calculator", "DatasetTask", "GuessNumber", "JsonlFormatError", "JsonlTask",
           "ReasoningGymTask", "RepeatDigit", "build_task", "load_jsonl"]


def build_task(train_cfg: Any, tokenizer: Any) -> Task:
    """The task ``train_cfg.task`` names (``train_cfg``: an ``inflight.trainer.config.TrainConfig``).
    With evaluation on, ``eval.prompts`` of its prompts are held out of training for it."""
    cfg, eval_size = train_cfg.task, (train_cfg.eval.prompts if train_cfg.eval.every else 0)
    if cfg.name == "repeat_digit":
        return RepeatDigit(tokenizer, cfg.completion_tokens, cfg.digit_credit)
    if cfg.name == "arithmetic":
        a = cfg.arithmetic
        return Arithmetic(digits=a.digits, terms=a.terms, ops=a.ops, template=a.template, eval_size=eval_size)
    if cfg.name == "jsonl":
        j = cfg.jsonl
        return JsonlTask(j.path or SAMPLE, match=j.match, reward=j.reward, eval_path=j.eval_path or None,
                         eval_size=eval_size)
    if cfg.name == "dataset":
        return DatasetTask(cfg.dataset, eval_size=eval_size)
    if cfg.name in ("calculator", "guess_number"):
        settings = getattr(cfg, cfg.name)
        cls = Calculator if cfg.name == "calculator" else GuessNumber
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}, eval_size=eval_size)
    if cfg.name == "reasoning_gym":
        r = cfg.reasoning_gym
        return ReasoningGymTask(datasets=r.datasets, weights=r.weights, options=r.options, size=r.size, seed=r.seed,
                                eval_seed=r.eval_seed, system_prompt=r.system_prompt, examples=r.examples,
                                chat=uses_chat(tokenizer, cfg.chat), eval_size=eval_size)
    if cfg.name == "verifiers":
        from inflight.trainer.envs.verifiers_env import VerifiersTask

        return VerifiersTask(train_cfg, tokenizer)
    if cfg.name == "openenv":
        from inflight.trainer.envs.openenv_env import OpenEnvTask

        return OpenEnvTask(cfg.openenv, eval_size=eval_size)
    if cfg.name == "skyrl_gym":
        from inflight.trainer.envs.skyrl_gym_env import SkyRLGymTask

        return SkyRLGymTask(cfg.skyrl_gym, eval_size=eval_size)
    task = load_factory(cfg.name)(tokenizer=tokenizer, **cfg.options)
    if not isinstance(task, Task) and not all(callable(getattr(task, m, None))
                                              for m in ("sample", "score", "eval_prompts")):
        raise TypeError(f"task.name={cfg.name!r} returned {type(task).__name__}, not a inflight.trainer.tasks.Task "
                        "(sample, score, eval_prompts)")
    return task
