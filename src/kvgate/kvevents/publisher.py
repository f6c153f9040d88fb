"""``EventPublisher``: KV event batches out on a ZMQ PUB socket in vLLM's frames, a ROUTER socket that
replays missed batches, and a snapshot of everything held for a subscriber the ring cannot catch up.

Threads.  One thread (``kvgate-kvevents``) owns both sockets (ZMQ sockets are not thread-safe) and
does every send.  ``publish(topic, events)`` is called on the event loop and never blocks it: it puts
the batch on a bounded queue (``queue_batches``); when that is full the batch is dropped and counted
(``stats["dropped"]``), and the thread leaves a hole in the sequence numbers for it, so a subscriber
sees a gap, asks for a replay, and gets a snapshot (the ring cannot replay a hole).

Frames (vLLM's, ``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``):

- PUB, one message per batch: ``[topic, seq, payload]``.  ``seq`` is 8 bytes big-endian, one counter
  per publisher across all its topics (so a subscriber must take every topic of a publisher to see its
  gaps; ``kvgate.kvevents.subscriber`` does, and filters topics itself).  kvgate's counter starts at 1:
  0 is never published, it is the ``seq`` of a snapshot taken before anything was.  ``payload`` is
  ``wire.encode_batch`` of an ``EventBatch``.
- ROUTER, a request (from a DEALER or REQ): ``[client id, b"", start]``, ``start`` 8 bytes big-endian.
  ``start`` of ``wire.END_SEQ`` (all bits set) asks for a snapshot.  Any other shape is ignored and
  counted (``stats["malformed_requests"]``).  vLLM's engines answer a snapshot request with just the
  end marker (no batch has that seq), so asking one is harmless there.
- ROUTER, the answer, each frame set ``[client id, b"", topic, seq, payload]``, then the end marker
  ``[client id, b"", b"", END_SEQ, b""]``:

  * the ring (the last ``buffer_batches`` published batches) holds every seq from ``start`` on: those
    batches, in order, with their own seq;
  * else (``start`` older than the ring, a hole since ``start``, or a snapshot asked): a snapshot.
    Let M be the last seq published when it starts.  First ``AllBlocksCleared`` under every topic this
    publisher has published or snapshotted, then the ``snapshot`` provider's batches (``BlockStored``
    of everything held, a chunk per batch; a topic seen first there gets its ``AllBlocksCleared``
    before its first chunk), all with seq M; then the ring's batches with seq > M (published while the
    snapshot ran).  Applying them in order gives the publisher's state: the snapshot reflects every
    batch up to M and maybe some later ones, and re-applying a suffix of a store/remove history to
    its result changes nothing.  If the ring lost batches after M during a long snapshot, the
    subscriber sees the gap and asks again.

One snapshot at a time: a snapshot request that comes while one runs waits its turn (at most
``MAX_WAITING`` wait; more get the end marker at once and may ask again).  Ring replays are answered
at once, also while a snapshot runs.  Answers are sent without blocking (``ROUTER_MANDATORY``,
``NOBLOCK``): one that meets a full pipe (the socket's ``SNDHWM``) waits in its place and resumes, a
subscriber that has gone is dropped; so memory stays bounded by the ring, the queue, the HWMs and one
snapshot chunk in flight.

The snapshot provider is a callable returning an async iterator of ``(topic, events)`` chunks; it runs
on ``loop`` (the gateway's) through ``run_coroutine_threadsafe``, handing chunks to the thread through a
small queue (``SNAPSHOT_CHUNKS_AHEAD``) and yielding the loop while that is full, so the loop is never
blocked and a slow subscriber holds at most that many chunks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import zmq

from kvgate.errors import ConfigError
from kvgate.kvevents.wire import END_SEQ, AllBlocksCleared, Event, EventBatch, encode_batch, seq_bytes

log = logging.getLogger(__name__)

SnapshotProvider = Callable[[], AsyncIterator[tuple[str, list[Event]]]]

_WAITING = object()  # a job's "nothing to send right now"


class EventPublisher:
    """Publishes KV event batches (see the module docstring for the frames).

    ``endpoint``: the PUB socket's, bound (``tcp://host:port``, ``ipc://...``); ``replay_endpoint``: the
    ROUTER's, or None for no replay.  ``start()`` binds both (raising ``ConfigError`` naming the
    endpoint if it cannot) and starts the thread; ``close()`` sends what is queued (up to
    ``close_timeout`` seconds) and stops.  ``stats``: counters, read from any thread.
    """

    MAX_WAITING = 16
    SNAPSHOT_CHUNKS_AHEAD = 4

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, buffer_batches: int = 10_000,
                 snapshot: SnapshotProvider | None = None, *, loop: asyncio.AbstractEventLoop | None = None,
                 queue_batches: int = 10_000, hwm: int = 100_000, data_parallel_rank: int | None = None,
                 endpoint_key: str = "kv_events_endpoint",
                 replay_endpoint_key: str = "kv_events_replay_endpoint"):
        if buffer_batches < 1:
            raise ValueError("buffer_batches must be at least 1")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._keys = (endpoint_key, replay_endpoint_key)
        self._snapshot = snapshot
        self._loop = loop
        self._rank = data_parallel_rank
        self._hwm = hwm
        self._queue: queue.Queue[tuple[str, list[Event], float] | None] = queue.Queue(maxsize=queue_batches)
        self._ring: deque[tuple[int, bytes, bytes | None]] = deque(maxlen=buffer_batches)  # None: a hole
        self._seq = 0  # the last seq published (0: none yet)
        self._topics: dict[bytes, None] = {}  # every topic published or snapshotted, in order
        self._dropped_seen = 0
        self._jobs: deque[tuple[bytes, Iterator[Any], list[bytes] | None]] = deque()
        self._waiting_snapshots: deque[tuple[bytes, int]] = deque()
        self._snapshot_running = False
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stats = {"published": 0, "dropped": 0, "holes": 0, "replays": 0, "snapshots": 0,
                      "snapshot_batches": 0, "malformed_requests": 0, "answers_dropped": 0}

    # --- the loop's side ------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the sockets and start the thread.  Raises ConfigError naming the endpoint's key if a
        bind fails (the address is in use, or not one this host has)."""
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self._hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            self._bind(self._pub, self.endpoint, self._keys[0])
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.SNDHWM, 10_000)
                self._replay.setsockopt(zmq.RCVHWM, 1_000)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._bind(self._replay, self.replay_endpoint, self._keys[1])
        except BaseException:
            self._close_sockets()
            raise
        # the sockets pass to the thread here; Thread.start is the memory barrier ZMQ asks for
        self._thread = threading.Thread(target=self._run, name="kvgate-kvevents", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str, key: str) -> None:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise ConfigError(f"{key}: cannot bind {endpoint!r}: {e.strerror} (is another process on it? "
                              f"pick a free address or unset {key})") from None

    def publish(self, topic: str, events: list[Event], ts: float | None = None) -> bool:
        """Queue one batch of ``events`` under ``topic``; never blocks.  False if the queue was full and
        the batch was dropped (counted; subscribers will see a gap and get a snapshot)."""
        try:
            self._queue.put_nowait((topic, events, time.time() if ts is None else ts))
            return True
        except queue.Full:
            self.stats["dropped"] += 1
            return False

    @property
    def last_seq(self) -> int:
        """The last sequence number published (0: none yet)."""
        return self._seq

    def close(self, close_timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``close_timeout`` s), stop the thread, close the sockets."""
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=close_timeout)
            except queue.Full:
                self._stop.set()
            self._thread.join(close_timeout)
            self._stop.set()
            self._thread.join(1.0)
            self._thread = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # --- the thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self._serve_replay()
                try:
                    # an answer waiting on the snapshot's provider polls at 1 ms, not in a spin (2 shared cores)
                    item = self._queue.get(timeout=0 if busy else (0.001 if self._jobs else 0.01))
                except queue.Empty:
                    continue
                if item is None:
                    break
                self._send_batch(*item)
                # drain what else is queued before looking at the replay socket again
                for _ in range(256):
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    self._send_batch(*item)
        except Exception:  # noqa: BLE001 - a dead publisher thread must say why
            log.exception("KV event publisher stopped")
        finally:
            self._stop.set()  # a snapshot's pump on the loop sees it and ends
            for _, frames, _ in self._jobs:
                close = getattr(frames, "close", None)
                if close is not None:
                    close()  # cancels a running snapshot's pump
            self._jobs.clear()

    def _send_batch(self, topic: str, events: list[Event], ts: float) -> None:
        dropped = self.stats["dropped"]
        if dropped != self._dropped_seen:  # batches were dropped before this one: leave a hole
            self._dropped_seen = dropped
            self._seq += 1
            self._ring.append((self._seq, b"", None))
            self.stats["holes"] += 1
        self._seq += 1
        t = topic.encode()
        self._topics.setdefault(t, None)
        payload = encode_batch(EventBatch(ts, events, self._rank))
        self._pub.send_multipart((t, seq_bytes(self._seq), payload))  # PUB never blocks: past HWM it drops
        self._ring.append((self._seq, t, payload))
        self.stats["published"] += 1

    def _serve_replay(self) -> bool:
        """Take waiting requests, advance the answers; True if anything was done."""
        if self._replay is None:
            return False
        done = False
        for _ in range(64):
            if not self._replay.poll(0, zmq.POLLIN):
                break
            frames = self._replay.recv_multipart()
            done = True
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.stats["malformed_requests"] += 1
                continue
            client, start = frames[0], frames[2]
            self._request(client, -1 if start == END_SEQ else int.from_bytes(start, "big"))
        if not self._snapshot_running and self._waiting_snapshots:
            client, start = self._waiting_snapshots.popleft()
            self._start_snapshot(client)
        return self._advance_jobs() or done

    def _request(self, client: bytes, start: int) -> None:
        self.stats["replays"] += 1
        if start >= 0:
            ring = list(self._ring)
            first = ring[0][0] if ring else self._seq + 1
            covered = start >= first or (start > self._seq)
            if covered and not any(p is None for s, _, p in ring if s >= start):
                self._jobs.append((client, iter([(t, s, p) for s, t, p in ring if s >= start]), None))
                return
        if self._snapshot_running:
            if len(self._waiting_snapshots) >= self.MAX_WAITING:
                self._jobs.append((client, iter(()), None))  # just the end marker: ask again later
            else:
                self._waiting_snapshots.append((client, start))
            return
        self._start_snapshot(client)

    def _start_snapshot(self, client: bytes) -> None:
        self.stats["snapshots"] += 1
        self._snapshot_running = True
        self._jobs.append((client, self._snapshot_frames(), None))

    def _snapshot_frames(self) -> Iterator[Any]:
        m = self._seq
        cleared = dict.fromkeys(self._topics)
        clear = encode_batch(EventBatch(time.time(), [AllBlocksCleared()], self._rank))
        try:
            for t in cleared:
                yield (t, m, clear)
            if self._snapshot is not None and self._loop is not None:
                chunks: queue.Queue[Any] = queue.Queue()
                fut = asyncio.run_coroutine_threadsafe(self._pump(chunks), self._loop)
                try:
                    while True:
                        try:
                            item = chunks.get_nowait()
                        except queue.Empty:
                            if fut.done() and chunks.empty():
                                exc = fut.exception()
                                if exc is not None:
                                    log.warning("KV events snapshot failed: %r", exc)
                                break
                            yield _WAITING
                            continue
                        if item is None:
                            break
                        topic, events = item
                        t = topic.encode()
                        if t not in cleared:
                            cleared[t] = None
                            self._topics.setdefault(t, None)
                            yield (t, m, clear)
                        self.stats["snapshot_batches"] += 1
                        yield (t, m, encode_batch(EventBatch(time.time(), events, self._rank)))
                finally:
                    fut.cancel()
            # what was published while it ran; a seq still in the ring from here is sent as it is now
            for s, t, p in list(self._ring):
                if s > m and p is not None:
                    yield (t, s, p)
        finally:
            self._snapshot_running = False

    async def _pump(self, chunks: queue.Queue[Any]) -> None:
        """On the loop: the provider's chunks into ``chunks``, at most SNAPSHOT_CHUNKS_AHEAD ahead."""
        try:
            async for chunk in self._snapshot():
                while chunks.qsize() >= self.SNAPSHOT_CHUNKS_AHEAD:
                    if self._stop.is_set():  # the thread is gone: nobody takes chunks any more
                        return
                    await asyncio.sleep(0.002)
                chunks.put(chunk)
        finally:
            chunks.put(None)

    def _advance_jobs(self) -> bool:
        """Send each answer's next frames until its pipe is full or it waits; True if any was sent."""
        sent = False
        for _ in range(len(self._jobs)):
            client, frames, pending = self._jobs.popleft()
            alive = True
            for _ in range(256):
                if pending is None:
                    try:
                        item = next(frames)
                    except StopIteration:
                        item = None
                    if item is _WAITING:
                        break
                    if item is None:
                        pending = [client, b"", b"", END_SEQ, b""]
                    else:
                        t, s, p = item
                        pending = [client, b"", t, seq_bytes(s), p]
                try:
                    self._replay.send_multipart(pending, zmq.NOBLOCK)
                    sent = True
                except zmq.Again:
                    break  # the subscriber's pipe is full: resume later
                except zmq.ZMQError:  # EHOSTUNREACH: the subscriber went away
                    self.stats["answers_dropped"] += 1
                    alive = False
                    break
                if pending[3] == END_SEQ:
                    alive = False
                    break
                pending = None
            if alive:
                self._jobs.append((client, frames, pending))
            else:
                frames_close = getattr(frames, "close", None)
                if frames_close is not None:
                    frames_close()  # a dropped snapshot stops, and frees the next
        return sent
