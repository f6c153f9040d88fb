"""Thread pools for blocking work, with deadlines and the bookkeeping status needs.

Card reads and writes and bulk copies run here, never on the event loop.

- ``IoPool``: a pool for work that cannot hang (memory copies).
- ``CardIo``: one pool per card, so a card that hangs (a dead NFS server, a
  stopped Redis) can only tie up its own threads.  Every call has a deadline
  (``io_timeout_ms``) that includes waiting for a free thread: the caller
  gets ``IoTimeout`` in time even when the thread itself stays stuck.  The
  stuck call goes on in its thread; its late result is dropped, and the work
  function is told through ``Abandon`` so it can refrain from publishing:
  ``run`` abandons it before it returns or raises for any reason other than
  the call's own end (deadline, cancellation), so once the caller has its
  answer nothing more goes through it.

A card also has one *hint* thread for best-effort work that speeds up reads
to come (``CardIo.hint``): it never holds a thread a read could use, and
callers never wait for it.

Each call is tracked while in flight, so the gateway can export the age of
the oldest one (a stuck card shows as a growing age long before anything
else notices).

Urgent calls.  The reads an engine on this host waits on (gets and lookups
over the local socket, the card reads and RAM-tier copies they make) are
marked ``urgent``, as are the read hints of those lookups; in a pool
made with ``realtime=True`` they run at real-time priority (``SCHED_RR``
1) and every other call (writes, scans, deletes, health checks) at normal
priority, switched per thread only when the class changes.  Why: an engine
waiting for a restore does not sleep.  vLLM's workers and engine core
poll for work with ``sched_yield`` loops, its CPU build's OpenMP threads
spin between kernels, and on a host with few cores the fair scheduler
shares the CPUs between those pollers and the very threads they wait on.
Measured on two vCPUs under vLLM's CPU engine: copying a 2 MiB object out
of the page cache took 15 ms instead of 0.3 ms, and page-cache restores
ran slower than reading the device.  At ``SCHED_RR`` the same copies ran
at 2 GB/s per thread.  The work is bounded (a batch the engine asked for),
so it cannot starve the host; the kernel's real-time throttling is the
backstop.
"""

from __future__ import annotations

import asyncio
import errno
import contextlib
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Iterable, TypeVar

from kvgate.latency import Latencies
from kvgate.memcopy import Abandon
from kvgate.errors import KvgateError

T = TypeVar("T")

log = logging.getLogger("kvgate.io")

# Hint calls that may wait for a card's hint thread; later ones are dropped.
HINT_BACKLOG = 4


class IoTimeout(KvgateError, TimeoutError):
    """A card I/O ran past its deadline (the thread may still be running it)."""


REALTIME_PRIORITY = 1  # the lowest SCHED_RR priority: above every normal thread, below the kernel's own


def realtime_permitted() -> bool:
    """Whether this process may put its threads at ``SCHED_RR`` (root, CAP_SYS_NICE or RLIMIT_RTPRIO)."""
    if not hasattr(os, "SCHED_RR"):
        return False
    allowed: list[bool] = []

    def probe() -> None:  # in a thread of its own, which then ends: no thread of ours keeps the class
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(REALTIME_PRIORITY))
            allowed.append(True)
        except OSError:
            allowed.append(False)

    t = threading.Thread(target=probe, name="kvgate-rt-probe")
    t.start()
    t.join()
    return allowed[0]


class _ThreadClass(threading.local):
    urgent = False


_thread_class = _ThreadClass()


_refused_logged = False


def _in_class(urgent: bool, fn: Callable[..., T], *args) -> T:
    """Run ``fn(*args)`` on this thread at the priority of its class (see "Urgent calls").

    A refused switch (the process moved to a cgroup without real-time
    runtime, say) leaves the thread where it is and is logged once: the
    call itself runs either way, since a priority is never worth a failed read.
    """
    global _refused_logged
    if _thread_class.urgent != urgent:
        try:
            if urgent:
                os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(REALTIME_PRIORITY))
            else:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            _thread_class.urgent = urgent
        except OSError as e:
            if not _refused_logged:
                _refused_logged = True
                log.warning("cannot switch an I/O thread's scheduling class (%s): it stays as it is", e)
    return fn(*args)


class ByteBudget:
    """Bounds bytes held at once (inline frames of all connections, staged puts).

    One holder may exceed the limit alone (``used == 0``): an object larger
    than the budget still goes, one at a time.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit or self.used == 0)
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


class IoPool:
    def __init__(self, threads: int, name: str = "kvgate-io", realtime: bool = False):
        """``realtime``: run urgent calls at ``SCHED_RR`` (the caller checked ``realtime_permitted``)."""
        self.threads = threads
        self.realtime = realtime
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._inflight: dict[int, float] = {}
        self._ids = itertools.count()

    def _track(self) -> int:
        ticket = next(self._ids)
        self._inflight[ticket] = time.monotonic()
        return ticket

    def _submit(self, fn: Callable[..., T], args: tuple, urgent: bool) -> "asyncio.Future[T]":
        # A pool without realtime never asks for the urgent class, so its threads never switch.
        return asyncio.get_running_loop().run_in_executor(self._executor, _in_class, urgent and self.realtime,
                                                          fn, *args)

    async def run(self, fn: Callable[..., T], *args, urgent: bool = False) -> T:
        """Run ``fn(*args)`` in the pool; the loop stays free meanwhile.

        ``urgent``: an engine waits on this call (see "Urgent calls").
        """
        ticket = self._track()
        try:
            return await self._submit(fn, args, urgent)
        finally:
            del self._inflight[ticket]

    async def map_chunks(self, fn: Callable[[list], T], items: list, min_chunk: int = 1,
                         urgent: bool = False) -> list[T]:
        """Split ``items`` into at most ``threads`` contiguous chunks, run ``fn`` on each at once."""
        if not items:
            return []
        chunks = split(items, self.threads, min_chunk)
        if len(chunks) == 1:
            return [await self.run(fn, chunks[0], urgent=urgent)]
        # Every chunk ends before this returns or raises: a chunk still
        # copying after the caller answered would write buffers it reuses.
        return await gather_all(*(self.run(fn, c, urgent=urgent) for c in chunks))

    def oldest_age(self) -> float:
        """Seconds the oldest in-flight call has been running (0 when idle)."""
        starts = list(self._inflight.values())
        return time.monotonic() - min(starts) if starts else 0.0

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def shutdown(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)


async def gather_all(*aws: Awaitable[T]) -> list[T]:
    """Every awaitable run to its end, then the first error raised, if any.

    For parts of one request that write or read the same buffers (copy
    chunks, one card's share of a put or a get): an error in one must not
    answer the request while another is still at work on them.
    """
    results = await asyncio.gather(*aws, return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
    return results  # type: ignore[return-value]


class CardGone(KvgateError, OSError):
    """A call on a card that has left the card set (its pool shut down): a failed I/O, as for a card gone."""

    def __init__(self) -> None:
        super().__init__(errno.ESHUTDOWN, "the card has left the card set")


class CardIo(IoPool):
    """The pool of one card: calls bounded by a deadline.

    The deadline of a call runs from when it gets a thread.  Waiting for a
    thread is bounded by the card's *progress*: as long as some call on the
    card finished within the deadline, a queued call waits its turn (a busy
    card is slow, not broken); when none has, the card is stuck and queued
    calls fail at once.
    """

    def __init__(self, threads: int, timeout_s: float, name: str, realtime: bool = False,
                 latencies: Latencies | None = None):
        super().__init__(threads, name, realtime)
        self.timeout_s = timeout_s
        self.latencies = latencies  # each call's seconds on its thread, under the called method's name
        self._hints = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-hint")
        self._hint_slots = threading.BoundedSemaphore(HINT_BACKLOG)
        self.hints_dropped = 0
        self._free = asyncio.Semaphore(threads)
        self._busy = 0
        self._progress = time.monotonic()  # last completion, or when the pool became busy

    async def _acquire(self) -> None:
        if self._busy == 0:
            self._progress = time.monotonic()
        if not self._free.locked():  # a thread is free: taken at once (wait_for would make a task of it)
            await self._free.acquire()
            return
        while True:
            remaining = self._progress + self.timeout_s - time.monotonic()
            if remaining <= 0:
                raise IoTimeout(f"no I/O on this card finished within {self.timeout_s * 1000:.0f} ms "
                                "(earlier I/Os are stuck)")
            try:
                await asyncio.wait_for(self._free.acquire(), remaining)
                return
            except (asyncio.TimeoutError, TimeoutError):
                continue  # a completion may have moved the deadline: look again

    async def run(self, fn: Callable[..., T], *args, abandon: Abandon | None = None, urgent: bool = False,
                  late: Callable[[T], None] | None = None) -> T:
        """``late``: given the result of a call that ends after its caller stopped waiting (past the
        deadline, cancelled), for a result that holds something to let go of (open files)."""
        loop = asyncio.get_running_loop()
        await self._acquire()
        deadline = loop.time() + self.timeout_s
        self._busy += 1
        ticket = self._track()
        started = time.monotonic()

        def done(_f) -> None:
            self._inflight.pop(ticket, None)
            self._busy -= 1
            self._progress = time.monotonic()
            self._free.release()
            if self.latencies is not None:
                self.latencies.observe(getattr(fn, "__name__", "call"), self._progress - started)

        try:
            fut = self._submit(fn, args, urgent)
        except RuntimeError:  # shut down: the card left the card set while this call waited for a thread
            done(None)
            raise CardGone() from None
        fut.add_done_callback(done)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - loop.time()))
        except (asyncio.TimeoutError, TimeoutError):
            fut.add_done_callback(_swallow if late is None else _hand_late(late))
            raise IoTimeout(f"card I/O ran past io_timeout_ms ({self.timeout_s * 1000:.0f} ms)") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if fut.cancelled() and not (task is not None and task.cancelling()):
                raise CardGone() from None  # queued when the card left: a failed I/O, not a cancelled request
            # the request went away: its buffers may be reused or unmapped
            fut.add_done_callback(_swallow if late is None else _hand_late(late))
            raise
        finally:
            if abandon is not None:  # after the call's own end this changes nothing
                abandon.abandon()


    def hint(self, fn: Callable[..., object], *args, urgent: bool = False) -> bool:
        """Run ``fn(*args)`` on the card's hint thread, without waiting for it.

        For work that only makes later reads faster: nothing waits for it, so
        it has no deadline; a card that hangs ties up its hint thread alone,
        and once ``HINT_BACKLOG`` calls are waiting, further ones are dropped
        (False) rather than queued behind it.
        """
        if not self._hint_slots.acquire(blocking=False):
            self.hints_dropped += 1
            return False

        def run() -> None:
            try:
                _in_class(urgent and self.realtime, fn, *args)
            except Exception:  # a hint is best effort: the read itself reports errors
                log.debug("read hint failed", exc_info=True)
            finally:
                self._hint_slots.release()

        try:
            self._hints.submit(run)
        except RuntimeError:  # shut down
            self._hint_slots.release()
            return False
        return True

    def shutdown(self, wait: bool = True) -> None:
        self._hints.shutdown(wait=False, cancel_futures=True)
        super().shutdown(wait)


class Tasks:
    """Background tasks of one owner (a card, the card set, the gateway), on the loop: each kept until it is
    done (a task nobody holds may be collected mid-flight), all cancelled together when the owner stops."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task] = set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def wait(self) -> None:
        """Until the tasks running now are done."""
        await asyncio.gather(*self._running, return_exceptions=True)

    async def cancel(self) -> None:
        for t in list(self._running):
            t.cancel()
        await self.wait()


def _swallow(fut) -> None:
    """Retrieve a late result or exception so asyncio does not log it as lost."""
    if not fut.cancelled():
        fut.exception()


def _hand_late(late: Callable[[Any], None]) -> Callable[[Any], None]:
    """A done callback that hands a late call's result to ``late`` (errors are swallowed, as ``_swallow``)."""

    def done(fut) -> None:
        if not fut.cancelled() and fut.exception() is None:
            late(fut.result())

    return done


def split(items: list, parts: int, min_chunk: int = 1) -> list[list]:
    """At most ``parts`` contiguous chunks of at least ``min_chunk`` items (but one)."""
    n = max(1, min(parts, len(items) // max(1, min_chunk)))
    size = -(-len(items) // n)
    return [items[i : i + size] for i in range(0, len(items), size)]


# One card call carries at most this much, so that io_timeout_ms bounds a
# fixed amount of work: a 1,024-object put split over 2 threads was 512 file
# writes in one call, and on a busy disk ran past the 2 s deadline: a card
# taken for stuck that was only busy.  More, smaller calls queue on the card
# instead, and queued calls wait as long as the card makes progress (CardIo).
# 32 objects of 1 MiB on a 100 MB/s share take about 0.3 s.
CALL_OBJECTS = 32
CALL_BYTES = 32 << 20

# A call is worth a thread of its own from about this much work: handing a call
# to a thread and its answer back costs 60-100 us here, and more while other
# threads hold the GIL.  A get of four 4 KiB objects from a warm card took 1.4-1.6
# ms split over four threads, as one call 0.66-0.78.
SPLIT_BYTES = 1 << 20
SPLIT_OBJECTS = 16


def worth_calls(objects: int, nbytes: int) -> int:
    """How many calls ``objects`` objects of ``nbytes`` in all are worth spreading over."""
    return max(1, -(-nbytes // SPLIT_BYTES), -(-objects // SPLIT_OBJECTS))


def split_calls(items: list, parts: int, sizes: list[int]) -> list[list]:
    """``items`` as contiguous chunks of one card call each: ``parts`` of them (the card's threads) where
    there is work enough for each (``worth_calls``), more where a chunk would carry over ``CALL_OBJECTS``
    objects or ``CALL_BYTES`` bytes (``sizes``, one per item); an object larger than ``CALL_BYTES`` is a
    call of its own."""
    total = sum(sizes)
    n = max(1, min(parts, len(items), worth_calls(len(items), total)), -(-len(items) // CALL_OBJECTS),
            -(-total // CALL_BYTES))
    chunks: list[list] = []
    start, nbytes = 0, 0
    for i, size in enumerate(sizes):
        # the i-th item starts the next of n even chunks, or would take this one past CALL_BYTES
        if i > start and (i * n // len(items) != start * n // len(items) or nbytes + size > CALL_BYTES):
            chunks.append(items[start:i])
            start, nbytes = i, 0
        nbytes += size
    if start < len(items):
        chunks.append(items[start:])
    return chunks


class KeyOrder:
    """Card operations on one key run in the order the event loop issued them.

    A delete is issued on the loop (an eviction, an expiry, a stale copy on
    another card) and runs later on a card thread; a write of the same key
    issued in between could land first and then be deleted: an object the
    client was told is stored, gone.  ``turn(keys)`` waits for every earlier
    operation on any of ``keys`` to end, and holds later ones until its own
    body ends.  ``writing(key)``: a write of the key is under way or waiting,
    so a delete meant for the object on the card now would hit the newer one
    (the caller drops it: the write replaces that object anyway).  Only
    operations that change what is on the card take turns; reads need none
    (they verify what they find).  Loop only; no locks.
    """

    def __init__(self) -> None:
        self._last: dict[bytes, asyncio.Future] = {}
        self._writes: dict[bytes, int] = {}

    def writing(self, key: bytes) -> bool:
        return key in self._writes

    @contextlib.asynccontextmanager
    async def turn(self, keys: Iterable[bytes], write: bool = False):
        keys = list(keys)
        mine = asyncio.get_running_loop().create_future()
        before = {id(f): f for f in (self._last.get(k) for k in keys) if f is not None}
        for k in keys:
            self._last[k] = mine
            if write:
                self._writes[k] = self._writes.get(k, 0) + 1
        earlier = asyncio.gather(*before.values()) if before else None
        try:
            if earlier is not None:
                await asyncio.shield(earlier)
            yield
        finally:
            if write:  # its body has ended (or never ran): a delete issued from now on is meant for it
                for k in keys:
                    n = self._writes[k] - 1
                    if n:
                        self._writes[k] = n
                    else:
                        del self._writes[k]
            mine.add_done_callback(lambda _f: self._forget(mine, keys))
            if earlier is not None and not earlier.done():
                # Cancelled while waiting: later operations must still wait for the earlier ones.
                earlier.add_done_callback(lambda _f: mine.done() or mine.set_result(None))
            else:
                mine.set_result(None)

    def _forget(self, mine: asyncio.Future, keys: list[bytes]) -> None:
        for k in keys:
            if self._last.get(k) is mine:
                del self._last[k]

    def pending(self) -> int:
        """Keys with an operation under way or waiting (for tests and status)."""
        return len(self._last)
