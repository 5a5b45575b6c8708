"""A two-seat verifiers 0.4 environment in kuhn_poker's shape, written against verifiers' public
API only (``task.env_id = "tests.vf_duel_env"``): a ``vf.Env`` whose config declares the seats
``first`` and ``second`` (each on verifiers' tool-less ``null`` harness by default), playing one
round of matching pennies over interactions. ``first`` names a coin, ``second`` is told it and
names one, ``first`` is told that and says ``[done]``. Zero-sum: ``first`` wins 1 on a match,
``second`` on a mismatch; a move that does not parse forfeits the round."""

import re

import verifiers.v1 as vf

RULES = "You are player {seat} of matching pennies. Answer with one move in brackets."
MOVES = ("heads", "tails")


def move(reply: str, legal: tuple[str, ...]) -> str | None:
    found = [m for m in re.findall(r"\[(\w+)\]", reply.lower()) if m in legal]
    return found[0] if len(found) == 1 else None


class DuelData(vf.TaskData):
    info: dict


class DuelTask(vf.Task[DuelData]):
    pass


class DuelEnvConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})
    second: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})


class DuelEnv(vf.Env[DuelEnvConfig]):
    async def run(self, task, agents):
        seats = [vf.Task(vf.TaskData(idx=task.data.idx, prompt=None, system_prompt=RULES.format(seat=i)))
                 for i in (0, 1)]
        ask = "Your move: [heads] or [tails]."
        async with agents.first.interaction(seats[0]) as first, agents.second.interaction(seats[1]) as second:
            a = move((await first.turn(ask)).last_reply, MOVES)
            b = move((await second.turn(f"Player 0 chose [{a}]. {ask}")).last_reply, MOVES) if a else None
            done = move((await first.turn(f"Player 1 chose [{b}]. Say [done].")).last_reply, ("done",)) if b else None
        net = (1.0 if a == b else -1.0) if a and b else (-1.0 if a is None else 1.0)
        for trace, reward in ((first.trace, net), (second.trace, -net)):
            trace.record_reward("payoff", reward)
            trace.info["duel"] = {"moves": [a, b], "done": done is not None}


class DuelTaskset(vf.Taskset[DuelTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield DuelTask(DuelData(idx=i, name=f"round#{i}", prompt=None, info={"seed": i}))


__all__ = ["DuelEnv", "DuelTaskset"]
