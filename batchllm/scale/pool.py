"""The running workers of a sharded job: one Ray actor per shard, watched and replaced.

A worker is replaced, with the rows of its shard not yet in parts, when it dies (a crash, or a
kill: the kernel's or Ray's out-of-memory killer, a lost node) or when it makes no progress (no
step run, no row finished) for engine.worker_timeout seconds: a hung worker (a stuck collective,
a wedged device) is killed, not waited for. A worker that cannot start (its model does not
load) is not restarted: the job fails with its reason. MAX_RESTARTS per worker, then the job
fails (its finished rows stay in parts: resume).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from batchllm.config import JobConfig
from batchllm.rows.writer import CheckpointWriter
from batchllm.scale.cluster import check_groups_fit, release_group, reserve_group, start_worker
from batchllm.scale.merge import WorkerRecord

MAX_RESTARTS = 3  # per worker; then the job fails (its finished rows stay in parts: resume)
FLUSH_SECONDS = 60.0  # how long an interrupted job waits for its workers to flush


@dataclass(eq=False)
class Work:
    """What the driver hands out: each worker's input rows, and how to start its run."""

    rows: list[np.ndarray]  # [N] sorted input row indices of each worker
    call: Callable  # (actor, worker, done rows) -> ObjectRef of the run's WorkerResult
    predict: Callable | None  # (worker, done rows) -> predicted prefill tokens; None: the
    # worker's own plan tells (partition)


def crashes() -> tuple[type[BaseException], ...]:
    """What a worker that died raises to the driver: a crash or a kill (retried alike)."""
    import ray.exceptions as rx

    return (rx.RayActorError, rx.OutOfMemoryError, rx.WorkerCrashedError, rx.NodeDiedError)


class _DeferredSignals:
    """SIGINT and SIGTERM recorded while the pool waits on Ray, and handed to the handlers that
    were set (run_job's: flush, then the resume command) between Ray's calls: an exception a
    handler raises inside one of Ray's calls comes out of it as a SystemError."""

    def __init__(self) -> None:
        self.handlers: dict[int, object] = {}
        self.caught: list[int] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[_DeferredSignals]:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.handlers[s] = signal.signal(s, lambda signum, frame: self.caught.append(
                    signum))
        try:
            yield self
        finally:
            for s, handler in self.handlers.items():
                signal.signal(s, handler)

    def deliver(self) -> None:
        """Call the handler of the first signal caught (it raises to stop the job)."""
        if self.caught:
            signum = self.caught.pop(0)
            handler = self.handlers.get(signum)
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL and signum == signal.SIGINT:
                raise KeyboardInterrupt


class WorkerPool:
    """Starts a worker per shard, watches them, replaces the dead and the stalled."""

    def __init__(self, cfg: JobConfig, writer: CheckpointWriter, work: Work,
                 records: list[WorkerRecord], done: set[int], gpus: bool) -> None:
        self.cfg, self.writer, self.work, self.records = cfg, writer, work, records
        self.done, self.gpus = done, gpus
        self.actors: dict[int, object] = {}  # worker -> its running actor
        self.groups: dict[int, object] = {}  # worker -> its devices' placement group, kept
        # across its restarts (engine.tensor_parallel > 1)
        self.running: dict[object, int] = {}  # ObjectRef of a run -> worker
        self._asked: dict[int, object] = {}  # worker -> its pending progress() call
        self._moved: dict[int, tuple[int, float]] = {}  # worker -> (progress, when it moved)

    def launch(self, k: int) -> None:
        """Start worker k on its shard's rows not done (nothing when none are left)."""
        if not set(self.work.rows[k].tolist()) - self.done:
            return
        if self.work.predict is not None:
            self.records[k].predicted_prefill_tokens = self.work.predict(k, self.done)
        if k not in self.groups:
            self.groups[k] = reserve_group(self.cfg, self.gpus)
        actor = start_worker(self.cfg, self.writer.fingerprint, self.writer.flush_rows, k,
                             self.records[k].restarts, self.gpus, self.groups[k])
        self.actors[k] = actor
        self.running[self.work.call(actor, k, self.done)] = k
        self._moved[k] = (-1, time.monotonic())

    def run(self, poll: Callable[[], None]) -> None:
        """Until every worker has finished its shard; poll() between waits (progress bar)."""
        import ray

        check_groups_fit(self.cfg, self.gpus)
        with _DeferredSignals().installed() as signals:
            for k in range(len(self.records)):
                self.launch(k)
            while self.running:
                ready, _ = ray.wait(list(self.running), num_returns=1, timeout=0.5)
                signals.deliver()
                poll()
                self._collect(ready)
                self._watch()

    def _collect(self, ready: list) -> None:
        """The results of the runs that ended: kept, or the dead worker replaced."""
        import ray

        for ref in ready:
            k = self.running.pop(ref)
            try:
                self.records[k].result = ray.get(ref)
                self._stop(k)  # its GPU goes to a worker still waiting for one
                release_group(self.groups.pop(k, None))
            except crashes() as died:
                if getattr(died, "actor_init_failed", False):  # a restart would not load
                    raise RuntimeError(f"worker {k} could not start: {died}") from died
                self._replace(k, died, stalled=False)


    def _watch(self) -> None:
        """Ask each worker its progress; replace one whose count has not moved for
        engine.worker_timeout seconds (since it was started, until it first answers)."""
        import ray

        now = time.monotonic()
        for k, actor in list(self.actors.items()):
            asked = self._asked.get(k)
            if asked is None:
                self._asked[k] = actor.progress.remote()
            elif ray.wait([asked], timeout=0)[0]:
                del self._asked[k]
                try:
                    count = ray.get(asked)
                except crashes():
                    continue  # its run's result says how it died
                if count != self._moved[k][0]:
                    self._moved[k] = (count, now)
            if now - self._moved[k][1] > self.cfg.engine.worker_timeout:
                self._replace(k, TimeoutError(
                    f"no progress for {self.cfg.engine.worker_timeout:g} s"), stalled=True)

    def _replace(self, k: int, why: BaseException, stalled: bool) -> None:
        """Worker k is gone (or killed here, stalled): again, on its rows not yet in parts."""
        for ref, worker in list(self.running.items()):
            if worker == k:
                del self.running[ref]
        self._stop(k)
        record = self.records[k]
        record.restarts += 1
        record.timeouts += stalled
        if record.restarts > MAX_RESTARTS:
            raise RuntimeError(f"worker {k} was replaced {record.restarts} times (last: {why}); "
                               f"its finished rows are in {self.writer.parts_dir}") from why
        now_done = self.writer.done_rows()
        shard = set(self.work.rows[k].tolist())
        record.rows_recovered += len((now_done - self.done) & shard)
        self.done = self.done | (now_done & shard)
        self.launch(k)

    def _stop(self, k: int) -> None:
        import ray

        actor = self.actors.pop(k, None)
        self._asked.pop(k, None)
        if actor is not None:
            ray.kill(actor)

    def flush(self) -> None:
        """Ask every running worker to write its finished rows to parts (the job is being
        interrupted), waiting up to FLUSH_SECONDS; a worker that cannot answer loses only its
        unflushed rows (they run again on resume)."""
        import ray

        calls = [actor.flush.remote() for actor in self.actors.values()]
        if calls:  # a dead worker's call ends at once: nothing of it to flush
            ray.wait(calls, num_returns=len(calls), timeout=FLUSH_SECONDS)

    def close(self) -> None:
        """Kill every worker still running; release their devices."""
        for k in list(self.actors):
            self._stop(k)
        for k in list(self.groups):
            release_group(self.groups.pop(k))
