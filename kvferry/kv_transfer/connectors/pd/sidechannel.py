"""The side channel's ZeroMQ transport: the prefill side's listening server and a one-shot
blocking call (the decode side's many concurrent calls go through :mod:`.peer_calls`).

One request, one reply, each a single frame of at most ``MAX_MESSAGE_BYTES``. A refused
peer learns only that it was refused; the details go to the local log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from kvferry.kv_transfer.connectors.pd.codec import Codec, ProtocolError
from kvferry.kv_transfer.connectors.pd.messages import (
    MAX_MESSAGE_BYTES,
    PeerReply,
    PeerRequest,
    Refused,
)

logger = logging.getLogger(__name__)


class PeerUnreachable(RuntimeError):
    """No answer from the peer's side channel in time."""


def endpoint(host: str, port: int | str) -> str:
    return f"tcp://{host}:{port}"


class SideChannelServer:
    """A ZeroMQ ROUTER on a daemon thread answering each request with ``handler(request)``.

    ``handler`` runs on the server thread; it must be thread-safe with respect to the
    engine's thread. Refusals and protocol errors are logged here (the peer gets them too).
    """

    def __init__(
        self,
        ctx: zmq.Context,  # type: ignore[type-arg]
        host: str,
        port: int,
        codec: Codec,
        handler: Callable[[PeerRequest, str], PeerReply],
        label: str = "P/D",
    ) -> None:
        self.label = label  # the transport family, for logs and errors
        self._codec = codec
        self._handler = handler
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            sock.bind(endpoint(host, port if port else "*"))
        except zmq.ZMQError as e:
            sock.close()
            raise RuntimeError(
                f"{label} side channel cannot listen on {endpoint(host, port)}: {e}"
            ) from None
        last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint = last  # what it listens on: the configured host, never more
        self.host = host
        self.port = int(last.rsplit(":", 1)[1])
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{label.lower()}-side-channel", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 3 or frames[1] != b"":
                continue  # not a REQ peer; nothing sensible to answer
            ident, _, payload = frames
            frame = self._answer(payload)
            try:
                sock.send_multipart([ident, b"", frame], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.debug("side channel: reply not sent: %s", e)
        sock.close()

    def _answer(self, payload: bytes) -> bytes:
        """The encoded reply. A peer refused for its credentials or its compatibility is
        told only that; the reason is logged here."""
        peer = "a side-channel peer"
        codec = self._codec
        nonce = b""
        try:
            env = codec.open_request(payload, peer)
            nonce = env.nonce  # authenticated: a refusal from here on answers this request
            codec.admit(env, peer)
            request = codec.request_of(env, peer)
            reply = self._handler(request, peer)
        except ProtocolError as e:
            logger.warning("%s side channel refused a request: %s", self.label, e)
            if e.public is not None:
                return codec.encode_reply(Refused(e.public), nonce)
            return codec.encode_reply(Refused(str(e)[:2048]), nonce)
        except Exception as e:  # a bug here must not kill the side channel
            logger.exception("%s side channel failed to answer", self.label)
            return codec.encode_reply(Refused(f"internal error: {type(e).__name__}"), nonce)
        if isinstance(reply, Refused) and not reply.retry:
            logger.warning(
                "%s side channel refused %s: %s", self.label, type(request).__name__, reply.reason
            )
        return codec.encode_reply(reply, nonce)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def call(
    ctx: zmq.Context,  # type: ignore[type-arg]
    host: str,
    port: int,
    codec: Codec,
    request: PeerRequest,
    timeout_s: float,
    label: str = "P/D",
) -> PeerReply:
    """Send one request to a side channel and return its typed reply.

    Raises PeerUnreachable (no answer in ``timeout_s``), IncompatiblePeer, Unauthenticated or
    ProtocolError."""
    peer = f"{host}:{port}"
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(endpoint(host, port))
        frame, nonce = codec.encode_request(request)
        sock.send(frame)
        if not sock.poll(int(timeout_s * 1000)):
            raise PeerUnreachable(f"no answer from the {label} side channel {peer} in {timeout_s}s")
        return codec.decode_reply(sock.recv(), peer, nonce)
    except zmq.ZMQError as e:
        raise PeerUnreachable(f"{label} side channel {peer}: {e}") from None
    finally:
        sock.close()
