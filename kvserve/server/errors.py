"""OpenAI-style errors: every 4xx/5xx the server sends is {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi.responses import JSONResponse


@dataclass(eq=False)  # exceptions must stay hashable
class APIError(Exception):
    """An error to hand back to the client as it is: the status and a message that names the problem."""

    status_code: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def bad_value(exc: ValueError, fields: set[str], default_param: str | None = None) -> APIError:
    """A 400 from an engine or SamplingParams ValueError; its message starts with the field at fault, if any."""
    message = str(exc)
    first_word = re.match(r"\w+", message.removeprefix("the "))
    param = first_word.group(0) if first_word and first_word.group(0) in fields else default_param
    return bad_request(message, param)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist; this server serves {served!r}", "model",
                    "model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key")


def payload_too_large(max_body_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {max_body_bytes:,} bytes "
                         f"(kvserve serve --max-body-size)", code="body_too_large")


def unsupported_media_type(content_type: str | None) -> APIError:
    got = f"got {content_type!r}" if content_type else "got none"
    return APIError(415, f"the request body must be JSON with the header 'Content-Type: application/json' ({got})",
                    code="unsupported_media_type")


def request_failed(reason: str) -> APIError:
    """The request was accepted and then failed inside the engine; the engine goes on serving the others."""
    return APIError(500, f"the request failed while generating: {reason}", code="request_failed", type="server_error")


def overloaded(num_waiting: int) -> APIError:
    return APIError(503, f"the server is overloaded: {num_waiting} sequences are already waiting (each of a "
                         f"request's n samples counts); retry later",
                    code="overloaded", type="server_error", headers={"Retry-After": "1"})


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is not serving: {reason}", code="engine_unavailable", type="server_error")
