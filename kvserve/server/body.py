"""Reading a request body at the edge, before any parsing: JSON only (415 otherwise, so a web page cannot make a
browser send a "simple" cross-site POST to a local server), and at most `max_body_bytes` (413), refused by its
Content-Length or, without one, as soon as that many bytes have come in."""
from __future__ import annotations

from starlette.requests import Request

from kvserve.server.errors import payload_too_large, unsupported_media_type

DEFAULT_MAX_BODY_BYTES = 2 << 20  # 2 MiB: a 128K-token prompt as text or token ids fits


def is_json_content_type(content_type: str | None) -> bool:
    """application/json or a +json type, parameters (charset) allowed, case-insensitive."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


async def read_json_body(request: Request, max_body_bytes: int) -> bytes:
    """The raw body of a JSON request; raises a 415 or 413 APIError without reading past the limit."""
    content_type = request.headers.get("content-type")
    if not is_json_content_type(content_type):
        raise unsupported_media_type(content_type)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise payload_too_large(max_body_bytes)
    chunks, num_bytes = [], 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_body_bytes:
            raise payload_too_large(max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)
