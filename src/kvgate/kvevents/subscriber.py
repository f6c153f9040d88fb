"""``Subscriber``: KV event batches of one publisher (a vLLM engine or a kvgate gateway), in sequence
order, with missed sequence numbers caught up through the publisher's replay socket.

Threading: a ``Subscriber`` is synchronous and belongs to one thread (it owns a SUB and a DEALER
socket, and ZMQ sockets are not thread-safe).  ``poll(timeout)`` returns the batches ready, in order;
iterating blocks.  ``start_thread(deliver)`` runs it in a daemon thread of its own and calls
``deliver(list_of_batches)`` there: an asyncio user hands them over with
``loop.call_soon_threadsafe``.  A thread rather than zmq.asyncio because a catch-up (a snapshot of a
million blocks takes seconds) would otherwise run on the caller's event loop.

What it delivers, ``(topic, seq, EventBatch)``:

- Live batches as published, each seq once, in increasing order.  A batch under a topic not in
  ``topics`` (prefixes; None: all) is not delivered, but still counts for gap detection, which is why
  the SUB socket takes every topic: a publisher's sequence numbers run across all its topics.
- On a gap (a seq more than one past the last), with a ``replay_endpoint``: it asks the publisher for
  everything from the first missing seq (``[b"", start]`` on a DEALER) and, while the answer streams,
  keeps (at most ``live_buffer`` of) the live batches aside.  It delivers the answer's batches with seq
  >= start, in the order they come (a kvgate publisher's snapshot: ``AllBlocksCleared`` then
  ``BlockStored`` of everything, all under one seq, see ``kvgate.kvevents.publisher``), then the live
  ones kept aside that are newer.  If that still leaves a gap it asks again, up to ``max_rounds`` times,
  then delivers past it and counts it in ``stats["gaps_unrecovered"]`` (a vLLM engine, whose ring does
  not reach back far enough and which has no snapshot, ends here).
- ``snapshot_on_join=True`` (the default, with a replay endpoint): the first thing it does is ask a
  snapshot (start ``END_SEQ``), so a late joiner starts from the publisher's whole state; a vLLM
  engine answers that with just the end marker, and the subscriber starts from the live stream.
- A publisher that restarts counts its seq again from the start (vLLM 0, kvgate 1): a live seq not
  above the last one read off the SUB socket (whose stream from one publisher only goes up) is taken
  for a restart (``stats["restarts"]``), and the subscriber joins again (a snapshot, with
  ``snapshot_on_join``); the consumer sees the snapshot's ``AllBlocksCleared``.

Payloads are decoded by ``kvgate.kvevents.wire.decode_batch`` (both event forms); a payload that does
not decode is skipped and counted (``stats["malformed"]``), its seq still counting as received.
A replay answer that goes silent for ``replay_timeout`` seconds is abandoned (the DEALER is remade, so
a late answer cannot be mistaken for the next one) and counted in ``stats["replay_timeouts"]``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import zmq

from kvgate.errors import InvalidArgument
from kvgate.kvevents.wire import END_SEQ, EventBatch, decode_batch, seq_bytes, seq_from_bytes

log = logging.getLogger(__name__)

Delivered = tuple[str, int, EventBatch]


class Subscriber:
    """See the module docstring.  ``endpoint``: the publisher's PUB address (connected);
    ``replay_endpoint``: its ROUTER address, or None (gaps are then only counted)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topics: Sequence[str] | None = None,
                 *, snapshot_on_join: bool = True, replay_timeout: float = 10.0, max_rounds: int = 3,
                 live_buffer: int = 100_000, hwm: int = 100_000):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topics = None if topics is None else tuple(topics)
        self.replay_timeout = replay_timeout
        self.max_rounds = max_rounds
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: seq numbers run across them
        self._sub.connect(endpoint)
        self._dealer: zmq.Socket | None = None
        self._live: deque[tuple[bytes, int, bytes]] = deque(maxlen=live_buffer)
        self._live_lost = False
        self._last: int | None = None
        self._live_max: int | None = None  # the highest seq read off the SUB socket
        self._snapshot_on_join = snapshot_on_join
        self._join_pending = snapshot_on_join and replay_endpoint is not None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stats = {"delivered": 0, "gaps": 0, "gaps_unrecovered": 0, "replays": 0, "replayed": 0,
                      "replay_timeouts": 0, "malformed": 0, "filtered": 0, "restarts": 0}

    @property
    def last_seq(self) -> int | None:
        """The last seq received (None before the first)."""
        return self._last

    # --- reading --------------------------------------------------------------------------------------

    def poll(self, timeout: float = 0.1) -> list[Delivered]:
        """The batches ready within ``timeout`` seconds (maybe none), in order, after any catch-up."""
        out: list[Delivered] = []
        if self._join_pending:
            self._join_pending = False
            self._catch_up(-1, out)
        if not self._sub.poll(int(timeout * 1000), zmq.POLLIN):
            return out
        for msg in self._pending_live():
            self._take(msg, out)
        return out

    def _pending_live(self):
        """The live messages waiting on the SUB socket (at most 10,000: a poll returns, then comes back),
        parsed; malformed ones are counted by ``_parse`` and skipped."""
        for _ in range(10_000):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._parse(frames)
            if msg is not None:
                yield msg

    def __iter__(self) -> Iterator[Delivered]:
        while not self._stop.is_set():
            yield from self.poll(0.1)

    def start_thread(self, deliver: Callable[[list[Delivered]], None], name: str = "kvgate-kvevents-sub") -> None:
        """Run ``poll`` in a daemon thread, calling ``deliver(batches)`` there for each non-empty result;
        ``close()`` stops it.  An exception of ``deliver`` is logged and the thread goes on."""
        def run() -> None:
            while not self._stop.is_set():
                try:
                    got = self.poll(0.1)
                except zmq.ZMQError:
                    if self._stop.is_set():
                        return
                    raise
                if got:
                    try:
                        deliver(got)
                    except Exception:  # noqa: BLE001 - the consumer's bug must not stop the stream
                        log.exception("KV events consumer failed")
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (if any) and close the sockets."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        self._sub.close(0)
        if self._dealer is not None:
            self._dealer.close(0)
        self._ctx.term()

    # --- internals ------------------------------------------------------------------------------------

    def _parse(self, frames: list[bytes]) -> tuple[bytes, int, bytes] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats["malformed"] += 1
            return None
        return frames[0], int.from_bytes(frames[1], "big"), frames[2]

    def _deliver(self, topic: bytes, seq: int, payload: bytes, out: list[Delivered]) -> None:
        self._last = seq if self._last is None else max(self._last, seq)
        name = topic.decode(errors="replace")
        if self.topics is not None and not name.startswith(self.topics):
            self.stats["filtered"] += 1
            return
        try:
            batch = decode_batch(payload)
        except InvalidArgument as e:
            self.stats["malformed"] += 1
            log.warning("KV event batch %d on %r skipped: %s", seq, name, e)
            return
        out.append((name, seq, batch))
        self.stats["delivered"] += 1

    def _take(self, msg: tuple[bytes, int, bytes], out: list[Delivered]) -> None:
        topic, seq, payload = msg
        live_max, self._live_max = self._live_max, seq
        if live_max is not None and seq <= live_max:
            # one publisher's PUB stream only goes up: it restarted and counts from 0 (vLLM) or 1 (kvgate)
            self.stats["restarts"] += 1
            self._last = None
            if self.replay_endpoint is not None and self._snapshot_on_join:
                self._live.append(msg)
                self._catch_up(-1, out)
                return
        if self._last is None:
            self._last = seq - 1
        if seq <= self._last:
            return  # already delivered (by a replay)
        if seq > self._last + 1:
            self.stats["gaps"] += 1
            if self.replay_endpoint is not None:
                self._live.append(msg)
                self._catch_up(self._last + 1, out)
                return
            self.stats["gaps_unrecovered"] += 1
        self._deliver(topic, seq, payload, out)

    def _catch_up(self, start: int, out: list[Delivered]) -> None:
        """Replay from ``start`` (-1: a snapshot), then the live batches kept aside; repeat while a gap
        remains, up to max_rounds."""
        for _ in range(self.max_rounds):
            self._replay(start, out)
            live, self._live = self._live, deque(maxlen=self._live.maxlen)
            lost, self._live_lost = self._live_lost, False
            gap_at = None
            for topic, seq, payload in sorted(live, key=lambda m: m[1]):
                if self._last is not None and seq <= self._last:
                    continue
                if self._last is not None and seq > self._last + 1 and gap_at is None:
                    gap_at = self._last + 1
                if gap_at is not None:
                    self._live.append((topic, seq, payload))
                    continue
                self._deliver(topic, seq, payload, out)
            if gap_at is None and not lost:
                return
            start = gap_at if gap_at is not None else (self._last or 0) + 1
        # give up: deliver past the gap
        self.stats["gaps_unrecovered"] += 1
        live, self._live = self._live, deque(maxlen=self._live.maxlen)
        for topic, seq, payload in sorted(live, key=lambda m: m[1]):
            if self._last is None or seq > self._last:
                self._deliver(topic, seq, payload, out)

    def _new_dealer(self) -> zmq.Socket:
        if self._dealer is not None:
            self._dealer.close(0)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.RCVHWM, 100_000)
        self._dealer.connect(self.replay_endpoint)
        return self._dealer

    def _replay(self, start: int, out: list[Delivered]) -> None:
        """Ask from ``start`` and deliver the answer (seq >= start) until its end marker; meanwhile keep
        live batches aside."""
        dealer = self._dealer or self._new_dealer()
        self.stats["replays"] += 1
        dealer.send_multipart([b"", END_SEQ if start < 0 else seq_bytes(start)])
        floor = max(start, 0)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._sub, zmq.POLLIN)
        deadline = time.monotonic() + self.replay_timeout
        first = True
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self.stats["replay_timeouts"] += 1
                log.warning("KV events replay from %s on %s went silent for %.0f s", start,
                            self.replay_endpoint, self.replay_timeout)
                self._new_dealer()
                return
            ready = dict(poller.poll(int(min(left, 0.5) * 1000)))
            if self._sub in ready:
                for msg in self._pending_live():
                    self._live_max = max(self._live_max or 0, msg[1])
                    if len(self._live) == self._live.maxlen:
                        self._live_lost = True
                    self._live.append(msg)
            if dealer in ready:
                for _ in range(10_000):
                    try:
                        frames = dealer.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    deadline = time.monotonic() + self.replay_timeout
                    if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                        self.stats["malformed"] += 1
                        continue
                    _, topic, seqf, payload = frames
                    if seqf == END_SEQ:
                        return
                    seq = seq_from_bytes(seqf)
                    if seq < floor:
                        continue
                    if first and start > 0 and seq > start and payload and not self._is_snapshot(payload):
                        # the publisher's ring no longer reaches back to start, and it sent no snapshot
                        self.stats["gaps_unrecovered"] += 1
                    first = False
                    self.stats["replayed"] += 1
                    self._deliver(topic, seq, payload, out)

    @staticmethod
    def _is_snapshot(payload: bytes) -> bool:
        try:
            events = decode_batch(payload).events
        except InvalidArgument:
            return False
        return bool(events) and type(events[0]).__name__ == "AllBlocksCleared"
