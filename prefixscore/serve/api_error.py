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


MAX_PRIORITY = 1 << 30  # the one range of `priority`, on HTTP (schemas.py) and gRPC alike


def check_priority(priority) -> None:
    """0 real-time, higher batch work (HTTP's schema checks it too; gRPC's int32 can be negative
    or past the range)."""
    if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
        raise ApiError(422, f"priority must be an integer from 0 (real-time) to {MAX_PRIORITY}, got "
                            f"{priority!r}", param="priority")
