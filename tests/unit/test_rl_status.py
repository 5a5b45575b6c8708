"""A refusal's HTTP status across vLLM's text-only utility-call boundary (``inflight.engine.rl_status``)."""

from __future__ import annotations

import pickle
from http import HTTPStatus

from inflight.engine.rl_status import answered
from inflight.engine.rpc import OUT_OF_ORDER
from inflight.engine.transfer_engine import RLApiError


def test_a_marked_refusal_becomes_vllms_graceful_error_with_its_status_and_message() -> None:
    from vllm.exceptions import GracefulHTTPError

    text = "Call to collective_rpc method failed: inflight: update_weights before start_weight_update (HTTP 409)"
    error = answered(Exception(text))
    assert isinstance(error, GracefulHTTPError) and error.http_status == HTTPStatus.CONFLICT
    assert str(error) == error.message == "inflight: update_weights before start_weight_update"
    multi = answered(Exception("inflight: a; inflight: b (HTTP 400)\n(ranks [0] had taken it) (HTTP 400)"))
    assert multi.http_status == HTTPStatus.BAD_REQUEST and multi.message.endswith("had taken it)")


def test_anything_else_is_left_as_it_is() -> None:
    for e in (Exception("Call to collective_rpc method failed: boom"), RuntimeError("inflight: x (HTTP 200)"),
              ValueError("inflight: x (HTTP 409) and more")):
        assert answered(e) is e


def test_a_refusal_keeps_its_status_through_pickle() -> None:
    e = pickle.loads(pickle.dumps(RLApiError("inflight: x", OUT_OF_ORDER)))
    assert type(e) is RLApiError and e.status == 409 and str(e) == "inflight: x"
    assert RLApiError("inflight: y").status == 400
