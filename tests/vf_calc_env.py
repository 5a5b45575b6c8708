"""A verifiers 0.4 environment written against its public API only (``task.env_id =
"tests.vf_calc_env"``): arithmetic with an MCP calculator (``tests.vf_calc_tools``), rewarded
by a rubric. A row whose ``fault`` is ``"rubric"`` has a rubric that raises."""

import verifiers.v1 as vf

from tests.vf_calc_tools import CalcTools

QUESTION = "What is (2+3)*2? Use the tools."
SYSTEM = "You are a calculator agent."


class CalcData(vf.TaskData):
    answer: int
    fault: str = ""


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        if task.fault == "rubric":
            raise RuntimeError("the rubric raised")
        return float(str(task.answer) in trace.last_reply)

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        yield CalcTask(CalcData(prompt=QUESTION, system_prompt=SYSTEM, answer=10), self.config.task)
        yield CalcTask(CalcData(prompt=QUESTION, system_prompt=SYSTEM, answer=10, fault="rubric"), self.config.task)


__all__ = ["CalcTaskset"]
