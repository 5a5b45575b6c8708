"""The MCP tools of ``tests.vf_calc_env`` (a module of their own: verifiers serves a
``vf.Toolset`` with ``python -m`` of its module). ``add`` with a negative ``a`` hangs: a tool
that never answers."""

import asyncio

import verifiers.v1 as vf


class CalcTools(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two numbers."""
        if a < 0:
            await asyncio.sleep(3600)
        return a + b

    @vf.tool
    async def mul(self, a: int, b: int) -> int:
        """Multiply two numbers."""
        return a * b


if __name__ == "__main__":
    CalcTools.run()
