"""The HTTP status of a refused RL API call: 4xx for a client's mistake, 5xx for the server's.

vLLM 0.32 passes an EngineCore utility call's error to its client as text alone
(``Call to <method> method failed: <message>``), so the ``RLApiError``'s status would be lost
on the way and every refusal would answer 500. EngineCore's side (``crossing``, from the
patched ``collective_rpc`` and ``set_weight_version``) ends the text of a refusal that leaves
its process with `` (HTTP <status>)``; the OpenAI server's side (``patch_rl_status_codes``)
reads it back and raises vLLM's own ``GracefulHTTPError``, which its handlers answer with that
status and the message as it was raised.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from inflight.engine.transfer_engine import RLApiError

_MARK = "__inflight_rl_status__"
MARKED = re.compile(r"^(?:Call to \w+ method failed: )?(?P<message>.*) \(HTTP (?P<status>[45]\d\d)\)$", re.S)
"""A refusal's text as an API server receives it; ``message`` is the ``RLApiError``'s own."""


def crossing(core: Any, error: RLApiError) -> RLApiError:
    """``error`` as it should leave EngineCore ``core``: with its status in its text where the
    core runs in a process of its own (``EngineCoreProc``: its clients read text), unchanged in
    process (``LLM`` without multiprocessing raises the error itself)."""
    from vllm.v1.engine.core import EngineCoreProc

    if not isinstance(core, EngineCoreProc):
        return error
    return RLApiError(f"{error} (HTTP {error.status})", error.status)


def answered(error: BaseException) -> BaseException:
    """The error a route of the API server should raise for ``error``: a ``GracefulHTTPError``
    with the refusal's status and message, or ``error`` itself when it is no refusal."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    found = MARKED.match(str(error))
    if found is None:
        return error
    return GracefulHTTPError(found["message"], HTTPStatus(int(found["status"])))


def patch_rl_status_codes() -> None:
    """Wrap ``AsyncLLM.collective_rpc`` and ``AsyncLLM.update_weight_version`` (vLLM 0.32.0;
    every RL route reaches EngineCore through one of them) so a refusal raises ``answered``'s
    error. Idempotent; raises if vLLM no longer has them."""
    from vllm.v1.engine.async_llm import AsyncLLM

    for name in ("collective_rpc", "update_weight_version"):
        original = getattr(AsyncLLM, name, None)
        if original is None:
            raise RuntimeError(f"inflight: vllm AsyncLLM has no {name}(); this vLLM is not 0.32-compatible")
        if getattr(original, _MARK, False):
            continue
        wrapped = _answering(original)
        setattr(wrapped, _MARK, True)
        setattr(AsyncLLM, name, wrapped)


def _answering(original: Any) -> Any:
    @functools.wraps(original)
    async def call(self, *args, **kwargs):
        try:
            return await original(self, *args, **kwargs)
        except Exception as e:
            error = answered(e)
            if error is e:
                raise
            raise error from None

    return call
