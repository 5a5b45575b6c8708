"""The harness of ``task.name = "verifiers"``: verifiers' chat loop, run in this process.

An agent turn is one ``/chat/completions`` call to the rollout's interception ``endpoint``
(which the engine answers, ``VerifiersTurns``); each tool call of the reply goes to its MCP
tool server (named ``<server>_<tool>``) and comes back as a ``role: tool`` message; a reply
without tool calls ends the rollout. A tool that raises answers its call with the error text
(the policy sees its mistake); a refused call (the turn limit, the episode's budget) ends the
rollout, and the rubric scores what there is.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import httpx
from mcp import Client
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult


class InflightHarness(Harness[HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = SUPPORTS_MCP = SUPPORTS_RESUME = True
    EXECUTES_CODE = NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, tool_interception_url: str | None = None) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [message_to_wire(m) for m in prompt or []]
        async with AsyncExitStack() as stack:
            tools, servers = await _tools(stack, mcp_urls)
            http = await stack.enter_async_context(
                httpx.AsyncClient(timeout=None, headers={"Authorization": f"Bearer {secret}"}))
            while True:
                body = {"model": ctx.model, "messages": messages, **({"tools": tools} if tools else {})}
                r = await http.post(f"{endpoint}/chat/completions", json=body)
                if r.status_code != 200:  # a stop condition or a refused call: the rollout ends here
                    return ProgramResult(1, "", r.text)
                message = r.json()["choices"][0]["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                if not message.get("tool_calls"):
                    return ProgramResult(0, "", "")
                for call in message["tool_calls"]:
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": await _call(servers, call["function"])})


async def _tools(stack: AsyncExitStack, mcp_urls: dict[str, str]) -> tuple[list[dict], dict[str, tuple[Any, str]]]:
    """The tools of every MCP server, as chat-completions ``tools``; name -> (client, tool)."""
    tools, servers = [], {}
    for server, url in mcp_urls.items():
        client = await stack.enter_async_context(Client(url))
        for t in (await client.list_tools()).tools:
            name = f"{server}_{t.name}"
            tools.append({"type": "function", "function": {"name": name, "description": t.description or "",
                                                           "parameters": t.input_schema}})
            servers[name] = (client, t.name)
    return tools, servers


async def _call(servers: dict[str, tuple[Any, str]], function: dict) -> str:
    """One tool call's result text; a call the policy got wrong (unknown tool, arguments that
    are not a JSON object) or a tool that raised: the error, as the tool's answer."""
    if function.get("name") not in servers:
        return f"error: no tool named {function.get('name')!r}"
    try:
        arguments = json.loads(function.get("arguments") or "{}")
        if not isinstance(arguments, dict):
            raise ValueError("the arguments are not a JSON object")
    except ValueError as e:
        return f"error: {e}"
    client, tool = servers[function["name"]]
    result = await client.call_tool(tool, arguments)
    return "\n".join(b.text for b in result.content if b.type == "text")


__all__ = ["InflightHarness"]
