"""The ``[task]`` section of the training config: what the policy is trained on."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from inflight.settings import check_choices
from inflight.trainer.envs.calculator import TEMPLATE as CALCULATOR_TEMPLATE
from inflight.trainer.envs.calculator import Calculator
from inflight.trainer.envs.guess_number import TEMPLATE as GUESS_TEMPLATE
from inflight.trainer.envs.guess_number import GuessNumber
from inflight.trainer.envs.jsonl import Match
from inflight.trainer.envs.openenv_env import OpenEnvConfig
from inflight.trainer.envs.skyrl_gym_env import SkyRLGymConfig
from inflight.trainer.tasks.task import ChatMode
from inflight.trainer.tasks.tool_calls import chat_template_text


@dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """Difficulty of the ``arithmetic`` task."""

    digits: int = 1
    """Digits of every operand (1: 0-9, 2: 10-99, ...)."""
    terms: int = 2
    """Operands per expression."""
    ops: tuple[str, ...] = ("+",)
    """Operators drawn from (any of + - *)."""
    template: str = "What is {expr}? Answer with just the number."
    """The prompt; ``{expr}`` becomes the expression."""

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"task.arithmetic.digits={self.digits} must be in 1..9")
        if self.terms < 2:
            raise ValueError(f"task.arithmetic.terms={self.terms} must be >= 2")
        if not self.ops or set(self.ops) - {"+", "-", "*"}:
            raise ValueError(f"task.arithmetic.ops={list(self.ops)} must be a non-empty subset of ['+', '-', '*']")
        if "{expr}" not in self.template:
            raise ValueError(f"task.arithmetic.template={self.template!r} has no {{expr}}")


@dataclass(frozen=True, kw_only=True)
class JsonlConfig:
    """The ``jsonl`` task's data: one ``{"prompt"|"messages": ..., "answer": ...}`` per line."""

    path: str = ""
    """Training prompts (empty: the sample file ``trainer/envs/data/sample_gsm.jsonl``)."""
    eval_path: str = ""
    """Held-out prompts for evaluation (empty: the last ``eval.prompts`` records of ``path``)."""
    match: Match = "number"
    """number: the completion's final number (GSM8K ``#### N`` style) equals the answer's.
    exact: the stripped completion equals the stripped answer."""
    reward: str = ""
    """A reward function ``"module:function"`` in place of ``match``: ``function(prompt,
    completion) -> float``, the record as a ``Prompt`` (``answer``, other keys in ``meta``), the
    completion's text (a module next to the config is found)."""

    def __post_init__(self) -> None:
        check_choices(self, "task.jsonl")
        for name in ("path", "eval_path"):
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                raise ValueError(f"task.jsonl.{name}={getattr(self, name)!r}: no such file")


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """The ``dataset`` task's data: a Hugging Face ``datasets`` dataset (``inflight.trainer.envs.hf_dataset``)."""

    path: str = ""
    """A hub id (``openai/gsm8k``), a directory written by ``save_to_disk``, or a data file
    (.json, .jsonl, .csv, .parquet); a relative local path is read next to the config file."""
    subset: str = ""
    """The hub dataset's configuration (``main`` for GSM8K; empty: its default)."""
    split: str = "train"
    """The training split."""
    eval_split: str = ""
    """The held-out split for evaluation (empty: the last ``eval.prompts`` rows of ``split``)."""
    prompt_field: str = "prompt"
    """The column holding each prompt's text (GSM8K: ``question``)."""
    messages_field: str = ""
    """A column of chat messages (``[{"role", "content"}, ...]``) to use instead of ``prompt_field``."""
    answer_field: str = "answer"
    """The column holding the reference answer."""
    max_rows: int = 0
    """Read at most this many rows of each split (0: all)."""
    match: Match = "number"
    """As ``task.jsonl.match``: the final number (GSM8K ``#### N``) or the exact text."""
    reward: str = ""
    """As ``task.jsonl.reward``: a ``"module:function"`` reward in place of ``match``."""

    def __post_init__(self) -> None:
        check_choices(self, "task.dataset")
        for name in ("split", "prompt_field", "answer_field"):
            if not getattr(self, name):
                raise ValueError(f"task.dataset.{name} is empty")
        if self.max_rows < 0:
            raise ValueError(f"task.dataset.max_rows={self.max_rows} must be >= 0 (0: all)")


@dataclass(frozen=True, kw_only=True)
class CalculatorConfig:
    """The ``calculator`` task (``inflight.trainer.envs.calculator``): arithmetic with a calculator tool."""

    digits: int = 2
    """Digits of each of the two operands (1: 0-9)."""
    ops: tuple[str, ...] = ("*",)
    """Operators drawn from (any of + - *)."""
    tool_credit: float = 0.2
    """Reward of an episode without the right answer that made a well-formed calculator call (< 1)."""
    max_result_digits: int = 30
    """The calculator refuses literals and values of more digits."""
    max_expression_chars: int = 100
    """The calculator refuses longer expressions."""
    template: str = CALCULATOR_TEMPLATE
    """The opening prompt; ``{expr}`` becomes the problem."""
    examples: int = 1
    """Worked episodes (a call, the tool's value, the answer) as chat turns before the problem;
    0 with ``task.chat = "off"``."""
    format: Literal["text", "native"] = "text"
    """text: the policy writes ``calc: <expression>`` lines. native: the calculator is a tool in
    the model's own tool-call format (the template's ``tools=``; calls read by ``task.tool_parser``;
    results as ``role: tool`` messages); the default template becomes "... Use the calculator tool ..."."""

    def __post_init__(self) -> None:
        _check_task(Calculator, "task.calculator", self)


@dataclass(frozen=True, kw_only=True)
class GuessNumberConfig:
    """The ``guess_number`` task (``inflight.trainer.envs.guess_number``): a secret number, higher/lower feedback."""

    lo: int = 1
    """The smallest secret."""
    hi: int = 100
    """The largest secret."""
    turn_penalty: float = 0.0
    """A win on reply k earns max(1 - turn_penalty * (k - 1), 0.5)."""
    closeness_credit: float = 0.2
    """A loss earns closeness_credit * (1 - |last guess - secret| / (hi - lo)), plus the consistency credit."""
    consistency_credit: float = 0.0
    """A loss earns consistency_credit * (share of replies inside the interval the feedback leaves open)."""
    show_range: bool = False
    """Feedback names the interval left: ``lower than 50: my number is between 1 and 49.``"""
    template: str = GUESS_TEMPLATE
    """The opening prompt, with ``{lo}`` and ``{hi}``."""
    examples: int = 1
    """Games won by binary search, as chat turns before this one; 0 with ``task.chat = "off"``."""

    def __post_init__(self) -> None:
        _check_task(GuessNumber, "task.guess_number", self)


@dataclass(frozen=True, kw_only=True)
class ReasoningGymConfig:
    """The ``reasoning_gym`` task (``inflight.trainer.envs.reasoning_mix``): a mix of reasoning-gym datasets."""

    datasets: tuple[str, ...] = ("basic_arithmetic",)
    """reasoning-gym dataset names (``reasoning_gym.factory.DATASETS``), drawn from by weight."""
    weights: tuple[float, ...] = ()
    """One weight per dataset, > 0 (empty: equal weights)."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per dataset, its reasoning-gym config's keyword arguments: ``{basic_arithmetic = {max_terms = 3}}``."""
    size: int = 100_000
    """Training entries the mix is drawn from (entry i of ``seed``)."""
    seed: int = 1
    """The training entries' seed."""
    eval_seed: int = 1_000_000
    """The held-out entries' seed (``eval.prompts`` of them); training never samples a held-out question."""
    system_prompt: str = "default"
    """A key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` (each asks for ``<answer>...</answer>``), or empty: none."""
    examples: int = 0
    """Worked examples before the problem, as chat turns: entries of the mix (from ``eval_seed``
    + 7919) asked and answered ``<answer>...</answer>``. A small model may answer in tags only with them."""

    def __post_init__(self) -> None:
        if not self.datasets or len(set(self.datasets)) != len(self.datasets):
            raise ValueError(f"task.reasoning_gym.datasets={list(self.datasets)} must name one dataset or more, "
                             "each once")
        if self.weights and len(self.weights) != len(self.datasets):
            raise ValueError(f"task.reasoning_gym.weights={list(self.weights)} must have one weight per dataset "
                             f"({len(self.datasets)}), or be empty")
        if not all(math.isfinite(w) and w > 0 for w in self.weights):
            raise ValueError(f"task.reasoning_gym.weights={list(self.weights)} must all be finite and > 0")
        if set(self.options) - set(self.datasets):
            raise ValueError(f"task.reasoning_gym.options names {sorted(set(self.options) - set(self.datasets))}, "
                             f"not in task.reasoning_gym.datasets={list(self.datasets)}")
        if self.size < 1:
            raise ValueError(f"task.reasoning_gym.size={self.size} must be >= 1")
        if self.examples < 0:
            raise ValueError(f"task.reasoning_gym.examples={self.examples} must be >= 0")
        if self.seed == self.eval_seed:
            raise ValueError(f"task.reasoning_gym.eval_seed={self.eval_seed} must differ from seed")


def _check_task(cls: Any, where: str, cfg: Any) -> None:
    """The task's own checks, at load time, the message naming the config table."""
    try:
        cls(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.{str(e).split(': ', 1)[-1]}") from None


@dataclass(frozen=True, kw_only=True)
class ScoringConfig:
    """Where rewards are computed: ``task.score`` in worker processes of the engine
    (``inflight.trainer.rollout.scoring_pool``), so a slow verifier never stops decoding."""

    workers: int = 1
    """Scoring processes per engine at the start; groups (and episode turns) are scored in
    parallel across them."""
    max_workers: int = 4
    """The most scoring processes per engine: while a call waits and every process is busy
    (a slow verifier, a tool that hangs until ``timeout_s``), one more starts, up to this."""
    timeout_s: float = 60.0
    """The longest one group's scoring may take; its worker (and whatever it started) is
    then killed and replaced, and the group fails."""
    memory_mb: int | None = 8192
    """Each scoring process's address-space cap (MiB, ``RLIMIT_AS``; importing torch takes about
    1 GiB of it on CPU); None: no cap. A call past it fails its group."""
    max_failed_in_a_row: int = 16
    """Groups whose scoring failed one after the other (an error, a timeout, a reward that is
    not a finite number; a multi-turn group counts once, at its first failed episode, and one
    that finishes with none starts the count again) before the run stops with the last one's
    message (the engine reports it to the trainer; nothing is restarted)."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"task.scoring.workers={self.workers} must be >= 1")
        if self.max_workers < self.workers:
            raise ValueError(f"task.scoring.max_workers={self.max_workers} must be >= task.scoring.workers="
                             f"{self.workers}")
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"task.scoring.timeout_s={self.timeout_s} must be a number of seconds > 0")
        if self.memory_mb is not None and self.memory_mb < 256:
            raise ValueError(f"task.scoring.memory_mb={self.memory_mb} must be >= 256 (MiB) or None")
        if self.max_failed_in_a_row < 1:
            raise ValueError(f"task.scoring.max_failed_in_a_row={self.max_failed_in_a_row} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class EpisodeConfig:
    """How episodes run and fail: an ``EpisodeTask``'s, and a single-turn task's one-turn ones
    (``on_failure``, ``on_restart``)."""

    max_turns: int = 4
    """The policy's turns per episode at most; the environment ends the episode on the last."""
    max_tokens: int = 1024
    """An episode's tokens after its prompt (the policy's and the environment's) at most; an
    episode that would grow past it takes its last turn early."""
    on_failure: Literal["drop_group", "reward"] = "drop_group"
    """What a failed episode (its environment or verifier raised, hung, or answered garbage)
    costs its group. drop_group: the group is dropped (counted). reward: the episode keeps its tokens
    and gets ``failure_reward``, and the group trains."""
    failure_reward: float = 0.0
    """on_failure = "reward": the failed episode's reward."""
    on_restart: Literal["resume", "drop"] = "resume"
    """Episodes in flight when their engine process stopped (restarted by the trainer, a
    crash, the end of a run that ``run.resume`` continues): resume them where they were
    (their tokens and tags kept; the next turn sampled by whatever version is live), or
    drop them. Counted either way (``inflight.trainer.rollout.episode_journal``)."""
    def __post_init__(self) -> None:
        check_choices(self, "task.episode")
        if self.max_turns < 1:
            raise ValueError(f"task.episode.max_turns={self.max_turns} must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"task.episode.max_tokens={self.max_tokens} must be >= 1")
        if not math.isfinite(self.failure_reward):
            raise ValueError(f"task.episode.failure_reward={self.failure_reward} must be a finite number")


@dataclass(frozen=True, kw_only=True)
class VerifiersConfig:
    """The ``verifiers`` task (``inflight.trainer.envs.verifiers_env``): a verifiers 0.4
    environment (``task.env_id``), its model calls sampled by the engine."""

    renderer: str = "auto"
    """The ``renderers`` renderer that turns each model call into token ids and bridges each
    turn from the last one's ids. auto: renderers' renderer for a model it knows by name
    (Qwen3, Llama 3, GLM, ...), else template. template: the policy's chat template
    (``task.chat_template``'s when set), each turn the episode's ids and the template's text
    for the new messages. Or a renderers config ``name`` (``qwen3``, ``llama-3``, ``glm-5``,
    ``default``: the chat template re-rendered each turn); one that does not fit the
    tokenizer is refused at the start."""
    renderer_options: dict[str, Any] = field(default_factory=dict)
    """A named renderer's other config fields (``default``: its ``tool_parser``, e.g.
    ``{tool_parser = "qwen3"}``). With ``task.tool_parser`` set, replies' tool calls are read
    from their text by that vLLM parser instead (a ``<tool_call>`` spelled in several tokens
    included); template without one reads them with ``hermes`` where its tool prompt asks for
    ``<tool_call>`` blocks."""
    taskset: dict[str, Any] = field(default_factory=dict)
    """The taskset's own config (``vf.TasksetConfig`` fields), besides its ``id``."""
    env: dict[str, Any] = field(default_factory=dict)
    """The environment's own config (``vf.EnvConfig`` fields besides the taskset: its knobs,
    a seat the policy does not play, e.g. ``{player1 = {model = "..."}}``)."""
    seats: tuple[str, ...] = ()
    """The seats (the environment's agent roles) the policy plays; empty: every one. Each seat
    of a rollout is one episode of its group (``rollout.group_size`` a multiple of them)."""
    max_rows: int = 0
    """At most this many of the taskset's rows (0: all; an infinite taskset takes 1024)."""

    def __post_init__(self) -> None:
        if not self.renderer:
            raise ValueError("task.verifiers.renderer must be 'auto', 'template' or a renderers config (e.g. 'qwen3')")
        if "id" in self.taskset:
            raise ValueError(f"task.verifiers.taskset.id={self.taskset['id']!r}: the taskset is task.env_id")
        if "taskset" in self.env:
            raise ValueError("task.verifiers.env.taskset: the taskset is task.env_id and task.verifiers.taskset")
        if len(set(self.seats)) != len(self.seats):
            raise ValueError(f"task.verifiers.seats={list(self.seats)} names a seat twice")
        if self.max_rows < 0:
            raise ValueError(f"task.verifiers.max_rows={self.max_rows} must be >= 0 (0: all)")


BUILTIN = ("repeat_digit", "arithmetic", "jsonl", "dataset", "calculator", "guess_number", "reasoning_gym",
           "verifiers", "openenv", "skyrl_gym")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """What the policy is trained on (``trainer/tasks``)."""

    name: str = "repeat_digit"
    """repeat_digit | arithmetic | jsonl | dataset | calculator | guess_number | reasoning_gym | verifiers | openenv |
    skyrl_gym, or your own ``pkg.module:factory`` (called as ``factory(tokenizer=..., **options)``, returning a
    ``inflight.trainer.tasks.Task``)."""
    completion_tokens: int = 16
    """Most tokens sampled per completion (generation also stops at the model's end-of-sequence)."""
    chat: ChatMode = "auto"
    """auto: a model whose tokenizer has a chat template gets its prompts through it. off: raw text."""
    digit_credit: float = 0.5
    """repeat_digit only: reward for a digit token that is not D (D itself earns 1). It makes
    learning reliable (every seed learns digits) and is a shortcut: policies rarely go on to read D."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """arithmetic only: difficulty."""
    jsonl: JsonlConfig = field(default_factory=JsonlConfig)
    """jsonl only: the files and how answers match."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """dataset only: the Hugging Face dataset, its columns and how answers match."""
    calculator: CalculatorConfig = field(default_factory=CalculatorConfig)
    """calculator only (multi-turn, a tool): difficulty and reward."""
    guess_number: GuessNumberConfig = field(default_factory=GuessNumberConfig)
    """guess_number only (multi-turn, feedback): range and reward."""
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """reasoning_gym only: the datasets, their weights and options, and the seeds."""
    env_id: str = ""
    """verifiers only: the environment's taskset, a module whose ``__all__`` names one
    ``vf.Taskset`` (verifiers' ``taskset.id``)."""
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    """verifiers only: the renderer and the taskset's config."""
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    """openenv only: the OpenEnv server, its action and observation fields, the seeds."""
    skyrl_gym: SkyRLGymConfig = field(default_factory=SkyRLGymConfig)
    """skyrl_gym only: the skyrl-gym environment, the SkyRL dataset rows, its env_config."""
    options: dict[str, Any] = field(default_factory=dict)
    """A ``module:factory`` task only: keyword arguments of the factory."""
    tool_parser: str = ""
    """vLLM's tool parser that reads the tool calls in each reply of a multi-turn task into
    ``EpisodeView.tool_calls`` (``hermes``: ChatML, Qwen, Hermes; ``pythonic``; any name in vLLM's
    ``ToolParserManager``); empty: none."""
    chat_template: str = ""
    """The chat template in place of the tokenizer's, wherever the task's prompts and
    observations are rendered (and in the checkpoint's tokenizer): ``chatml_tools`` (shipped:
    ChatML with Hermes tool calls, for chat models whose template has no tools, such as
    SmolLM2) or a Jinja file; empty: the tokenizer's own."""
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Where and how long rewards (and an episode's environment turns) are computed."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Multi-turn tasks only: turns, token budget, failures and restarts."""

    def __post_init__(self) -> None:
        check_choices(self, "task")
        if self.name not in BUILTIN and not _FACTORY.match(self.name):
            raise ValueError(f"task.name={self.name!r} is not one of {list(BUILTIN)} or a 'pkg.module:factory'")
        if self.options and self.name in BUILTIN:
            raise ValueError(f"task.options={self.options!r}: only a 'module:factory' task takes options "
                             f"({self.name} is configured by its own table)")
        if self.completion_tokens < 1:
            raise ValueError(f"task.completion_tokens={self.completion_tokens} must be >= 1")
        if self.name == "dataset" and not self.dataset.path:
            raise ValueError("task.name = 'dataset' needs task.dataset.path: a hub id (openai/gsm8k), a directory "
                             "written by save_to_disk, or a data file")
        if self.name == "reasoning_gym":
            from inflight.trainer.envs.reasoning_mix import check_dataset_names

            check_dataset_names(self.reasoning_gym.datasets)
        if self.name == "verifiers" and not self.env_id:
            raise ValueError("task.name = 'verifiers' needs task.env_id: the taskset's module (verifiers' taskset.id)")
        if self.env_id and self.name != "verifiers":
            raise ValueError(f"task.env_id={self.env_id!r}: only task.name = 'verifiers' takes an environment id")
        if self.chat_template:
            chat_template_text(self.chat_template)  # shipped, or a file that exists
        if self.name == "calculator" and self.calculator.format == "native" and not self.tool_parser:
            raise ValueError("task.calculator.format = 'native' needs task.tool_parser (hermes for ChatML models, "
                             "with task.chat_template = 'chatml_tools' when the model's own template has no tools)")
        if not 0 <= self.digit_credit <= 1:
            raise ValueError(f"task.digit_credit={self.digit_credit} must be in [0, 1]")
