"""The gateway's answer to an error Result (gateway/app.py ``_result_error``)."""

from __future__ import annotations

from gateway.app import _result_error
from schemas import Result, ResultCode


def _result(**kw: object) -> Result:
    return Result.model_validate(
        {"query_id": "q1", "tenant": "t", "instance_id": "", "model": "", "finished_at": 1.0,
         "error": "not routed (deferred): x", **kw}  # fmt: skip
    )


def test_a_budget_give_up_is_429_insufficient_quota() -> None:
    err = _result_error(_result(code=ResultCode.INSUFFICIENT_QUOTA))
    assert (err.status, err.kind, err.code) == (429, "insufficient_quota", "insufficient_quota")


def test_other_give_ups_and_engine_errors_keep_their_status() -> None:
    for res in (_result(code=ResultCode.NOT_ROUTED), _result()):  # older routers set no code
        err = _result_error(res)
        assert (err.status, err.kind, err.code) == (503, "service_unavailable", "not_routed")
    err = _result_error(_result(instance_id="i1", model="m", error="engine died"))
    assert (err.status, err.code) == (502, "engine_error")


def test_a_shed_query_is_503_with_code_shed() -> None:
    err = _result_error(_result(code=ResultCode.SHED, error="not routed (rejected): shed: x"))
    assert (err.status, err.kind, err.code) == (503, "service_unavailable", "shed")
