"""A verifiers 0.4 environment with its own harness, written against verifiers' public API only
(taskset ``tests.vf_two_turn_env``, harness ``tests.vf_two_turn_harness``): the harness asks
twice, a user turn between; the rubric rewards an episode of two turns."""

import verifiers.v1 as vf

PROMPT = "count the cats"


class TwoTurnTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def two_turns(self, trace) -> float:
        return float(trace.num_turns == 2)


class TwoTurnTaskset(vf.Taskset[TwoTurnTask, vf.TasksetConfig]):
    def load(self):
        yield TwoTurnTask(vf.TaskData(prompt=PROMPT), self.config.task)


__all__ = ["TwoTurnTaskset"]
