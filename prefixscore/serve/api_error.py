"""ApiError: a request's failure as an HTTP status and detail, raised anywhere in a front end
(frontend.py, catalog.py) and answered by each route in its own shape (gRPC maps the status)."""
from __future__ import annotations

import math


class ApiError(Exception):
    """param: the request field at fault, for error shapes that name it (vLLM's)."""

    def __init__(self, status: int, detail: str, retry_after: float | None = None,
                 param: str | None = None):
        super().__init__(detail)
        self.status, self.detail, self.param = status, detail, param
        self.headers = {} if retry_after is None else {"Retry-After": str(max(1, math.ceil(retry_after)))}


def check_priority(priority) -> None:
    """0 real-time, higher batch work (HTTP's schema checks it too; gRPC's int32 can be negative)."""
    if type(priority) is not int or priority < 0:
        raise ApiError(422, f"priority must be an integer >= 0 (0: real-time), got {priority!r}",
                       param="priority")
