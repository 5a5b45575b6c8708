"""The task API: prompts, completions and turns, ``Task`` (one completion per prompt, scored by a
verifier) and ``EpisodeTask`` (multi-turn), the tool-call toolbox, and prompt encoding. The
environments ``inflight`` ships are written against it in ``inflight.trainer.envs``, which
also builds the one ``task.name`` names (``build_task``); this package imports none of them.
"""

from __future__ import annotations

from inflight.trainer.tasks.episode import EpisodeTask
from inflight.trainer.tasks.task import (
    Completion,
    EpisodeView,
    Prompt,
    Task,
    Turn,
    encode_prompt,
    final_number,
    load_factory,
    model_stop_ids,
    stop_token_ids,
    uses_chat,
)

__all__ = ["Completion", "EpisodeTask", "EpisodeView", "Prompt", "Task", "Turn", "encode_prompt", "final_number",
           "load_factory", "model_stop_ids", "stop_token_ids", "uses_chat"]
