"""Running the app: the port is bound before the model loads (a busy port fails in a second, not after the
load), connections that do not send their request headers in time are closed, and SIGTERM / SIGINT drain:
the listening socket closes, open generations may finish for `drain_timeout` seconds, and what is still open
then is cut (streams end with an error event and [DONE]); a second signal, SIGTERM or SIGINT, cuts what is
open at once and quits (the cut streams end as above; a third signal stops waiting for them too). The body's own timeout (a 408) is the routes' (routes.py `read_body`)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import EntMTPError

CUT_GRACE_S = (
    5  # after the drain: time for cut requests to write their last event before uvicorn cancels them
)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or an EntMTPError naming the address and the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise EntMTPError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; is another server running there? "
            "choose another --port (or stop that server)"
        ) from None


_LOADING_BODY = json.dumps(
    {
        "status": "loading",
        "error": {
            "message": "the model is loading: retry shortly",
            "type": "server_error",
            "code": "loading",
        },
    }
).encode()
LOADING = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_LOADING_BODY)).encode() + b"\r\n\r\n" + _LOADING_BODY
)


class Loading:
    """While the model loads on a bound port (`bind` comes first), every request is answered at once with a
    503 `{"status": "loading", ...}` (OpenAI's error shape, Retry-After: 1): a load balancer's /health polls
    learn the server is not ready instead of waiting in the listen backlog, to be answered all at once when
    serving starts. A context manager: the socket is handed back, blocking, when it exits."""

    def __init__(self, sock: socket.socket):
        self.sock, self.stop = sock, threading.Event()
        self.thread = threading.Thread(target=self._answer, name="entmtp-loading", daemon=True)

    def __enter__(self) -> Loading:
        self.sock.settimeout(0.1)  # the loop looks at `stop` this often
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.settimeout(None)

    def _answer(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.recv(65536)  # the request's head, whatever it asks
                    conn.sendall(LOADING)
                except OSError:
                    pass  # a client that left: nothing to answer


def _protocol(header_timeout: float) -> type[H11Protocol]:
    class HeaderTimeout(H11Protocol):
        """uvicorn's h11 protocol, closing a connection whose next request's headers do not arrive within
        `header_timeout` s of it opening or of its previous response (uvicorn has no such limit: a client
        that connects and sends nothing, or half a header, held the connection forever)."""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            self.loop.call_later(header_timeout, self._header_timeout, self.cycle)

        def _header_timeout(self, cycle) -> None:
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if waiting and not self.transport.is_closing():  # no new request began since
                self.transport.close()

    return HeaderTimeout


class _Server(uvicorn.Server):
    """uvicorn's server: the first SIGTERM / SIGINT drains; a second one, of either kind, skips the rest of the
    drain (what is open is cut now and its streams end in OpenAI's shape) and quits; a third stops waiting even
    for that (uvicorn's force_exit)."""

    def __init__(self, config: uvicorn.Config, drain, cut):
        super().__init__(config)
        self.drain = drain  # a coroutine function: lets open generations finish, then cuts the rest
        self.cut = cut  # cuts every open generation now
        self.skip_drain = False  # a second signal came

    def handle_exit(self, sig, frame) -> None:
        # uvicorn's own: a second SIGINT forces its exit, a second SIGTERM does nothing, and neither ends a drain
        self._captured_signals.append(sig)
        if self.skip_drain:
            self.force_exit = True
        elif self.should_exit:
            self.skip_drain = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting at once; the drain can take a while
            server.close()
        drain = asyncio.ensure_future(self.drain())
        while not drain.done() and not self.skip_drain:
            await asyncio.wait({drain}, timeout=0.05)
        if not drain.done():  # a second signal: cut what is open and go
            drain.cancel()
            self.cut()
        await super().shutdown(sockets)
        self._captured_signals.clear()  # a drained shutdown exits 0, not by re-raising the signal


def serve(
    app,
    sock: socket.socket,
    *,
    drain_timeout: float = 30.0,
    header_timeout: float = 10.0,
    access_log: bool = True,
    verbose: bool = False,
) -> None:
    """Serve `app` (create_app's) on the bound `sock` until SIGTERM / SIGINT, then drain."""
    if access_log:
        logger = logging.getLogger("entmtp.server")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s entmtp: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    config = uvicorn.Config(
        app,
        log_level="info" if verbose else "warning",
        access_log=False,  # ours is in the app: one line per request with its request id
        http=_protocol(header_timeout),
        timeout_graceful_shutdown=CUT_GRACE_S,  # counted after the drain
    )
    state = app.state.server
    _Server(config, lambda: state.drain(drain_timeout), state.cut).run(sockets=[sock])
