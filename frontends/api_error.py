"""ApiError: an error the client caused or should see, answered in OpenAI's error shape."""
from __future__ import annotations

from frontends import api_responses as r


class ApiError(Exception):
    """An HTTP status with OpenAI's error object: `message` for the client, `param` the request field at
    fault (or None), `code` OpenAI's machine-readable code (or None)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> r.ErrorResponse:
        return r.error(self.status, self.message, self.param, self.code)
