"""One error contract for the whole system: a stable machine-readable ``code`` plus a human message.

Every failure that crosses a boundary (engine API, NATS reply, HTTP response) is a ``DeepinferError``.
``code`` values are part of the wire protocol: never rename one, only add.
"""
from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    INVALID_REQUEST = "invalid_request"      # malformed or out-of-range field (HTTP 400)
    PROMPT_TOO_LONG = "prompt_too_long"      # prompt + max_tokens exceeds the context window (HTTP 400)
    MODEL_NOT_FOUND = "model_not_found"      # unknown model id or missing path (HTTP 404)
    MODEL_CORRUPT = "model_corrupt"          # truncated/corrupt checkpoint or unsupported architecture
    UNSUPPORTED_VERSION = "unsupported_version"  # wire-protocol version mismatch
    PAYLOAD_TOO_LARGE = "payload_too_large"  # message over the size limit (HTTP 413)
    OVERLOADED = "overloaded"                # admission control said no (HTTP 429)
    TIMEOUT = "timeout"                      # a deadline passed (HTTP 504)
    CANCELLED = "cancelled"                  # client cancelled or vanished
    WORKER_LOST = "worker_lost"              # a worker died mid-request (HTTP 502)
    TRANSFER_FAILED = "transfer_failed"      # KV hand-off failed
    UNAVAILABLE = "unavailable"              # no worker can serve the request now (HTTP 503)
    MODEL_MISMATCH = "model_mismatch"        # KV or work of another model build (fingerprint): refused (HTTP 502)
    INTERNAL = "internal"                    # a bug: logged with a traceback (HTTP 500)


HTTP_STATUS = {
    ErrorCode.INVALID_REQUEST: 400, ErrorCode.PROMPT_TOO_LONG: 400, ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.MODEL_CORRUPT: 500, ErrorCode.UNSUPPORTED_VERSION: 400, ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.OVERLOADED: 429, ErrorCode.TIMEOUT: 504, ErrorCode.CANCELLED: 499,
    ErrorCode.WORKER_LOST: 502, ErrorCode.TRANSFER_FAILED: 502, ErrorCode.UNAVAILABLE: 503,
    ErrorCode.MODEL_MISMATCH: 502, ErrorCode.INTERNAL: 500,
}


class DeepinferError(Exception):
    """An error with a stable code. ``str(err)`` is ``"<code>: <message>"``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]


def invalid(message: str) -> DeepinferError:
    """Shorthand for the most common error: a bad request field."""
    return DeepinferError(ErrorCode.INVALID_REQUEST, message)
