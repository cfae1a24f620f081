"""Reading request bodies: a byte limit on what is read and a deadline on the whole of it, for
every route (``/offer``, ``POST /voices``, the OpenAI and ElevenLabs routes).

A compatibility route renders :class:`HttpError` in its own API's error shape; elsewhere the
app's error middleware renders it as ``{"error": {"code", "message"}}``. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import TypeVar

import aiohttp
from aiohttp import web
from aiohttp.streams import EofStream

T = TypeVar("T")


class HttpError(Exception):
    """Raised by a handler (or a helper it calls) to answer with a JSON error."""

    def __init__(self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


class ClientGoneError(Exception):
    """The client reset or closed its connection while sending its request body."""


async def read_within(what: str, read: Awaitable[T], timeout_s: float) -> T:
    """One read of the request body, at most ``timeout_s`` (the client stalled: 408) and
    never a traceback when the client resets (:class:`ClientGoneError`)."""
    try:
        return await asyncio.wait_for(read, timeout_s)
    except TimeoutError:
        raise _timeout(what, timeout_s) from None
    except _GONE as e:
        raise _gone(what, e) from None


async def read_body(request: web.Request, limit: int, what: str, timeout_s: float) -> bytes:
    """The whole request body, enforcing ``limit`` (bytes) on the bytes read -- a chunked body
    has no Content-Length -- and ``timeout_s`` (``server.body_timeout_s``) on the whole of it.

    Raises :class:`HttpError` 413 ``too_large`` or 408 ``timeout`` (``what`` names the body in
    the message), or :class:`ClientGoneError`.
    """
    if (request.content_length or 0) > limit:
        raise _too_large(what, limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise _too_large(what, limit)
    except TimeoutError:
        raise _timeout(what, timeout_s) from None
    except _GONE as e:
        raise _gone(what, e) from None
    return bytes(body)


#: What reading a body raises when the client resets or closes its connection.
_GONE = (ConnectionError, aiohttp.ClientPayloadError, EofStream)


def _too_large(what: str, limit: int) -> HttpError:
    return HttpError(413, "too_large", f"the {what} is at most {limit} bytes")


def _timeout(what: str, timeout_s: float) -> HttpError:
    return HttpError(408, "timeout", f"the {what} did not arrive within {timeout_s:g} s")


def _gone(what: str, e: BaseException) -> ClientGoneError:
    return ClientGoneError(f"the client went away while sending the {what} ({type(e).__name__})")
