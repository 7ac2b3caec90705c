"""Grammar compilation off the engine thread, bounded in time and in queue length.

A :class:`CompilePool` runs each constraint's check and compilation (the backend's
``validate`` then ``compile``) on one of ``num_workers`` workers, so the engine thread
never waits for it:

* Worker processes when the backend offers a :meth:`process compiler
  <schedkit.core.structured_output.StructuredOutputBackend.process_compiler>` (the
  xgrammar backend does). A compile that outlives its timeout, or that no request waits
  for any more (every request that wanted it was aborted), is stopped by killing its
  process; the worker is started again for the next job. Processes are forked from a
  zygote that has already imported the backend's module (:mod:`schedkit.core.compile_worker`),
  so a new worker takes milliseconds, not a fresh interpreter's seconds.
* Threads otherwise (a plugin's backend that cannot be shipped to a process). A Python
  thread cannot be stopped: at its timeout, or when nobody waits for it, the job fails
  (or is dropped) at once and its thread is left to finish on its own while the worker
  takes the next job; at most ``num_workers`` such abandoned threads may run, beyond that
  the workers wait for them.

The queue in front of the workers is fair between owners (round robin over each owner's
first job; the manager's owner is the request's client and tenant) and bounded: in total
and per owner. A full queue refuses the submission (:class:`CompileQueueFull`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from schedkit.core.compile_worker import Zygote

log = logging.getLogger("schedkit.structured_output")

POLL_S = 0.02
"""How often a worker checks its running job for a timeout or a cancellation."""
WORKER_START_TIMEOUT_S = 120.0
"""Longest wait for a worker process to connect (the first waits for the zygote to
import the backend's modules)."""

CompileFn = Callable[[Any], Any]
"""Checks and compiles one constraint; raises ValueError naming what is wrong."""
ProcessCompilerFactory = Callable[[], CompileFn]
"""Picklable; called once in each worker process, it returns that process's compile
function, whose results must be picklable (the backend loads them back)."""


class CompileTimeout(Exception):
    """A compilation ran longer than the pool's timeout (and was stopped)."""


class CompileQueueFull(Exception):
    """The queue holds as many jobs as it may (in total, or for this owner)."""


class CompileFailed(Exception):
    """A worker process's compile raised something other than ValueError/TypeError, or
    the process is gone."""


@dataclass(eq=False)
class CompileJob:
    """One constraint being compiled, shared by every request that waits for it."""

    key: Hashable
    params: Any
    owner: Hashable
    future: Future[Any] = field(default_factory=Future)
    waiters: set[str] = field(default_factory=set)
    """Request ids waiting for it; when the last one leaves, the job is cancelled."""

    @property
    def is_wanted(self) -> bool:
        return bool(self.waiters) and not self.future.done()


class FairQueue:
    """Jobs by owner, taken round robin over the owners; bounded in total and per owner."""

    def __init__(self, max_jobs: int, max_jobs_per_owner: int) -> None:
        self.max_jobs = max_jobs
        self.max_jobs_per_owner = max_jobs_per_owner
        self._by_owner: OrderedDict[Hashable, deque[CompileJob]] = OrderedDict()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, job: CompileJob) -> None:
        """Raises:
            CompileQueueFull: ``max_jobs`` jobs are queued, or ``max_jobs_per_owner`` of
                this job's owner.
        """
        if self._len >= self.max_jobs:
            raise CompileQueueFull(f"{self._len} compiles are queued (the limit)")
        jobs = self._by_owner.get(job.owner)
        if jobs is not None and len(jobs) >= self.max_jobs_per_owner:
            raise CompileQueueFull(f"this client has {len(jobs)} compiles queued (the per-client limit)")
        if jobs is None:
            jobs = self._by_owner[job.owner] = deque()
        jobs.append(job)
        self._len += 1

    def pop(self) -> CompileJob | None:
        """The next owner's first job (the owner then goes last), or None when empty."""
        while self._by_owner:
            owner, jobs = self._by_owner.popitem(last=False)
            job = jobs.popleft()
            self._len -= 1
            if jobs:
                self._by_owner[owner] = jobs
            return job
        return None

    def remove(self, job: CompileJob) -> bool:
        """Drop a queued job; False when it is not queued."""
        jobs = self._by_owner.get(job.owner)
        if jobs is None or job not in jobs:
            return False
        jobs.remove(job)
        self._len -= 1
        if not jobs:
            del self._by_owner[job.owner]
        return True

    def drain(self) -> list[CompileJob]:
        jobs = [j for q in self._by_owner.values() for j in q]
        self._by_owner.clear()
        self._len = 0
        return jobs


class CompilePool:
    """Args:
        compile_fn: Checks and compiles a constraint in this process (the thread workers).
        num_workers: Jobs running at once.
        timeout_s: Longest a job may run once a worker started it.
        max_queued: Jobs waiting for a worker, in total.
        max_queued_per_owner: Jobs waiting for a worker, per owner.
        process_compiler: When given, jobs run in worker processes: called there once,
            it returns that process's compile function.
        load: Turns what a worker process returned into the compiled grammar (run on
            the worker's thread in this process).
        preload: Modules the process workers' zygote imports once (the backend's).
    """

    def __init__(self, compile_fn: CompileFn, *, num_workers: int, timeout_s: float,
                 max_queued: int, max_queued_per_owner: int,
                 process_compiler: ProcessCompilerFactory | None = None,
                 load: Callable[[Any], Any] | None = None, preload: tuple[str, ...] = ()) -> None:
        self.timeout_s = timeout_s
        self._compile_fn = compile_fn
        self._process_compiler = process_compiler
        self._load = load or (lambda payload: payload)
        self._queue = FairQueue(max_queued, max_queued_per_owner)
        self._jobs: dict[Hashable, CompileJob] = {}
        """Queued and running jobs by key (a new request for the same key joins its job)."""
        self._cv = threading.Condition()
        self._closed = False
        self._abandoned: list[threading.Thread] = []
        self.num_timeouts = 0
        self.num_cancelled = 0
        zygote = Zygote(preload, WORKER_START_TIMEOUT_S) if process_compiler is not None else None
        self._zygote = zygote
        self._workers = [_Worker(self, i, zygote) for i in range(num_workers)]

    def submit(self, key: Hashable, params: Any, owner: Hashable, waiter: str) -> Future[Any]:
        """The future of ``key``'s compilation: the job already queued or running for it
        (``waiter`` joins it), or a new one.

        Raises:
            CompileQueueFull: A new job does not fit in the queue.
        """
        with self._cv:
            if self._closed:
                raise RuntimeError("the compile pool is shut down")
            job = self._jobs.get(key)
            if job is None:
                job = CompileJob(key, params, owner)
                self._queue.push(job)
                self._jobs[key] = job
                self._cv.notify()
            job.waiters.add(waiter)
            return job.future

    def release(self, key: Hashable, waiter: str) -> None:
        """``waiter`` no longer waits for ``key``; a job nobody waits for is cancelled (a
        running one is stopped: its process killed, its thread abandoned)."""
        with self._cv:
            job = self._jobs.get(key)
            if job is None or waiter not in job.waiters:
                return
            job.waiters.discard(waiter)
            if job.waiters:
                return
            queued = self._queue.remove(job)
            # A running job: its worker sees it unwanted at its next poll.
        if queued:
            self._finish(job, cancel=True)

    def shutdown(self) -> None:
        """Cancel every job and stop the workers (their processes killed)."""
        with self._cv:
            self._closed = True
            queued = self._queue.drain()
            self._cv.notify_all()
        for job in queued:
            self._finish(job, cancel=True)
        for w in self._workers:
            w.stop()
        if self._zygote is not None:
            self._zygote.stop()

    # -- for the workers -----------------------------------------------------------------
    def _take(self) -> CompileJob | None:
        """The next job (blocks); None once the pool is shut down."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                job = self._queue.pop()
                if job is not None:
                    return job
                self._cv.wait()

    def _finish(self, job: CompileJob, *, result: Any = None, error: BaseException | None = None,
                cancel: bool = False) -> None:
        """Settle a job. The future is settled outside the pool's lock: its callbacks take
        the manager's lock, which is held around :meth:`submit`."""
        with self._cv:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            if job.future.done():
                return
            if cancel:
                self.num_cancelled += 1
            elif isinstance(error, CompileTimeout):
                self.num_timeouts += 1
        if cancel:
            job.future.cancel()
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _timed_out(self) -> CompileTimeout:
        return CompileTimeout(f"compiling took longer than {self.timeout_s:g} s "
                              "(structured_outputs.compile_timeout_s); it was stopped")

    def _wait_for_abandoned(self) -> None:
        """Threads that cannot be stopped: at most ``num_workers`` of them run on."""
        while True:
            with self._cv:
                self._abandoned = [t for t in self._abandoned if t.is_alive()]
                if len(self._abandoned) <= len(self._workers) or self._closed:
                    return
                oldest = self._abandoned[0]
            oldest.join(POLL_S)


class _Worker:
    """One slot of the pool: a thread in this process that takes jobs and runs each in
    its worker process (or in a thread of its own), watching its deadline."""

    def __init__(self, pool: CompilePool, index: int, zygote: Zygote | None) -> None:
        self.pool = pool
        self.zygote = zygote
        self.pid: int | None = None
        self.conn: Connection | None = None
        self.thread = threading.Thread(target=self._loop, name=f"schedkit-grammar-{index}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        pool = self.pool
        if self.zygote is not None:
            self._start_process()  # ready before the first job
        while (job := pool._take()) is not None:
            if not job.is_wanted:
                pool._finish(job, cancel=True)
                continue
            try:
                if self.zygote is not None:
                    self._run_in_process(job)
                else:
                    self._run_in_thread(job)
            except BaseException as e:  # a bug here must not leave its requests waiting
                log.exception("grammar compile worker failed")
                pool._finish(job, error=e)
        self._kill()

    # -- processes -----------------------------------------------------------------------
    def _start_process(self) -> None:
        assert self.zygote is not None
        try:
            self.pid, self.conn = self.zygote.fork()
            self.conn.send(self.pool._process_compiler)
        except (OSError, EOFError) as e:
            log.error("could not start a grammar compile worker process: %s", e)
            self._kill()
            return

    def _kill(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.conn is not None:
            self.conn.close()
        self.pid = self.conn = None

    def _run_in_process(self, job: CompileJob) -> None:
        pool = self.pool
        if self.conn is None:
            self._start_process()
        try:
            if self.conn is None:
                raise OSError("it could not be started (logged)")
            self.conn.send(job.params)
        except (OSError, ValueError) as e:
            self._kill()
            pool._finish(job, error=CompileFailed(f"the grammar compile worker process is gone: {e}"))
            return
        deadline = time.monotonic() + pool.timeout_s
        try:
            while not self.conn.poll(POLL_S):
                stopped = self._stop_reason(job, deadline)
                if stopped is not None:
                    self._kill()  # the only way to stop a compile in C++
                    if stopped == "cancel":
                        pool._finish(job, cancel=True)
                    else:
                        pool._finish(job, error=pool._timed_out())
                    if not pool._closed:
                        self._start_process()  # the next job's worker, started now
                    return
            status, payload = self.conn.recv()
        except (EOFError, OSError):
            self._kill()
            pool._finish(job, error=CompileFailed("the grammar compile worker process died"))
            return
        if status == "ok":
            try:
                pool._finish(job, result=pool._load(payload))
            except Exception as e:
                pool._finish(job, error=e)
        else:
            pool._finish(job, error=ValueError(payload) if status == "invalid" else CompileFailed(payload))

    def _stop_reason(self, job: CompileJob, deadline: float) -> str | None:
        """"cancel" when nobody waits for the job (it then leaves the pool's jobs under
        the lock, so no new request joins it), "timeout" past its deadline, or None."""
        pool = self.pool
        with pool._cv:
            if pool._closed or not job.waiters:
                if pool._jobs.get(job.key) is job:
                    del pool._jobs[job.key]
                return "cancel"
        if time.monotonic() >= deadline:
            return "timeout"
        return None

    # -- threads -------------------------------------------------------------------------
    def _run_in_thread(self, job: CompileJob) -> None:
        pool = self.pool
        pool._wait_for_abandoned()
        box: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append(("ok", pool._compile_fn(job.params)))
            except BaseException as e:
                box.append(("err", e))
            done.set()

        thread = threading.Thread(target=run, name="schedkit-grammar-compile", daemon=True)
        thread.start()
        deadline = time.monotonic() + pool.timeout_s
        while not done.wait(POLL_S):
            stopped = self._stop_reason(job, deadline)
            if stopped is not None:
                with pool._cv:
                    pool._abandoned.append(thread)
                if stopped == "cancel":
                    pool._finish(job, cancel=True)
                else:
                    pool._finish(job, error=pool._timed_out())
                return
        status, value = box[0]
        if status == "ok":
            pool._finish(job, result=value)
        else:
            pool._finish(job, error=value)

    def stop(self) -> None:
        self.thread.join(5)
        self._kill()
