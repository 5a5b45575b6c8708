"""The harness of ``tests.vf_two_turn_env``, on verifiers' public ``Harness`` and the ``openai``
SDK: two chat calls to the rollout's endpoint, ``and now 0`` asked between them.
``between_turns``, when a test sets it, runs (in a thread) after the first reply."""

import asyncio
from collections.abc import Callable
from typing import Any

import openai
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult

between_turns: Callable[[], None] | None = None


class TwoTurnHarness(Harness[HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = SUPPORTS_MCP = SUPPORTS_RESUME = True
    EXECUTES_CODE = NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, tool_interception_url: str | None = None) -> ProgramResult:
        _, prompt = self.resolve_prompt(data)
        messages = [{"role": "user", "content": prompt}]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        for turn in range(2):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"and now {turn}"}]
            if turn == 0 and between_turns is not None:
                await asyncio.to_thread(between_turns)
        return ProgramResult(0, "", "")


__all__ = ["TwoTurnHarness"]
