"""engine.tensor_parallel: N ranks run one model, driven by one engine.

Rank 0 is the job's own process: it runs the engine as with one device. Its model is rank 0's
shard (model/tensor_parallel.py), whose `hidden` and `logits` first broadcast what the other
ranks need to run theirs: the step's ids, positions, metadata and sample rows, and the page
copies (a shared prefix's partial page) the engine made since the last step. Ranks 1..N-1 are
processes this module spawns (torch.multiprocessing, a rendezvous on a free loopback port): each
loads its shard, holds a KV pool of its own heads (the same page ids as rank 0's) and loops on
those messages; the collectives inside the shards (all-reduce, all-gather) join the ranks.
gloo on the CPU, NCCL on CUDA. A rank that dies makes the next collective fail: the job stops
with one line naming the rank and its exit code. A rank whose rank 0 dies (a SIGKILL, or a Ray
worker killed by its driver) exits within a second: it holds no device its replacement needs.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchllm.model.attention import PagedAttention, StepMetadata, kv_cache_dtype
from batchllm.model.errors import ModelError
from batchllm.model.loader import LoadedModel, load_model

_STOP, _HIDDEN, _LOGITS = "stop", "hidden", "logits"
_current: Group | None = None  # this process's group (torch.distributed has one default group)


class RankFailed(RuntimeError):
    """A rank of a tensor-parallel group died or lost its connection."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, n: int, port: int, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"  # the rank's GPU is current already
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n, timeout=timedelta(seconds=600))


def _on_cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _meta_to(meta: StepMetadata, device: torch.device) -> StepMetadata:
    return dataclasses.replace(meta, **{
        f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)})


def _send(message: tuple) -> None:
    dist.broadcast_object_list([message], src=0)


class Group:
    """Rank 0's end: the spawned ranks, and the wrapping of its model and KV pool."""

    def __init__(self, procs: list, loaded: LoadedModel) -> None:
        self.procs = procs
        self.copies: list[tuple[list[int], list[int]]] = []
        self.closed = False
        model = loaded.model
        hidden, logits = model.hidden, model.logits

        def sent_hidden(input_ids, positions, attention, sample_rows):
            meta = dataclasses.replace(attention.meta, **{
                f.name: _on_cpu(getattr(attention.meta, f.name))
                for f in dataclasses.fields(attention.meta)})
            copies, self.copies = self.copies, []
            self._collective(_send, (_HIDDEN, input_ids.cpu(), positions.cpu(), meta,
                                     sample_rows.cpu(), copies))
            return self._collective(hidden, input_ids, positions, attention, sample_rows)

        def sent_logits(h):
            self._collective(_send, (_LOGITS,))
            return self._collective(logits, h)

        model.hidden, model.logits = sent_hidden, sent_logits

    def watch(self, attention: PagedAttention) -> None:
        """Rank 0's page copies, repeated by every rank before its next step."""
        copy = attention.copy_pages

        def copied(src: list[int], dst: list[int]) -> None:
            copy(src, dst)
            if src:
                self.copies.append((list(src), list(dst)))

        attention.copy_pages = copied

    def _collective(self, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, ConnectionError) as e:
            for p in self.procs:
                p.join(timeout=5)
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1)
                    if p.exitcode is not None]
            who = (", ".join(f"rank {r} exited with code {c}" for r, c in dead)
                   or f"a rank lost its connection ({str(e).splitlines()[0]})")
            self.closed = True
            raise RankFailed(f"engine.tensor_parallel: {who}; the job stops") from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            _send((_STOP,))
        except (RuntimeError, ConnectionError):
            pass
        for p in self.procs:
            p.join(timeout=30)
        dist.destroy_process_group()


def _exit_with(parent: int) -> None:
    """Exit this process (a rank > 0) once `parent` (rank 0's process) is gone, even while the
    main thread waits in a collective."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="batchllm-rank-0-watch").start()


def _worker(rank: int, n: int, port: int, model: str, kwargs: dict, parent: int,
            loaded_ranks) -> None:
    _exit_with(parent)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    try:
        loaded = load_model(model, shard=(rank, n), **kwargs)
    except Exception as e:  # noqa: BLE001 - told to rank 0, which stops the job with it
        loaded_ranks.put((rank, (type(e).__name__, str(e))))
        loaded_ranks.close()
        loaded_ranks.join_thread()
        os._exit(1)
    loaded_ranks.put((rank, None))
    _init(rank, n, port, loaded.device)
    (pool,) = _receive()[0]
    num_pages, page_size, kv_setting = pool
    m = loaded.model
    s = m.shape
    attention = PagedAttention(s.num_layers, num_pages, page_size, s.num_heads, s.num_kv_heads,
                               s.head_dim, m.dtype, loaded.device, m.ops,
                               kv_dtype=kv_cache_dtype(kv_setting, m.dtype))
    dev = loaded.device
    h = None
    while True:
        try:
            message = _receive()[0]
        except (RuntimeError, ConnectionError):
            return  # rank 0 is gone: its own error (or exit) is the one the user sees
        kind = message[0]
        if kind == _STOP:
            break
        if kind == _HIDDEN:
            _, ids, positions, meta, sample_rows, copies = message
            for src, dst in copies:
                attention.copy_pages(src, dst)
            attention.meta = _meta_to(meta, dev)
            h = m.hidden(ids.to(dev), positions.to(dev), attention, sample_rows.to(dev))
        else:
            m.logits(h)
    dist.destroy_process_group()


def _receive() -> list:
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box


def start(model: str, n: int, load_kwargs: dict) -> tuple[LoadedModel, Group]:
    """Spawn ranks 1..n-1, load rank 0's shard here, join the group: (rank 0's model, group).
    The ranks join only once every one has loaded its shard: one that fails or dies while
    loading stops the start at once, naming it (its error, or its exit code), where rank 0
    waited in the rendezvous for its 600 s timeout, deaf to SIGTERM; the others are stopped."""
    global _current
    if _current is not None:  # one group per process: an earlier runtime's ranks stop
        _current.close()
    port = _free_port()
    ctx = mp.get_context("spawn")
    loaded_ranks = ctx.Queue()  # (rank, None) once loaded, (rank, why) when its load failed
    procs = [ctx.Process(target=_worker, args=(r, n, port, model, load_kwargs, os.getpid(),
                                               loaded_ranks), daemon=True)
             for r in range(1, n)]
    for p in procs:
        p.start()
    try:
        loaded = load_model(model, shard=(0, n), **load_kwargs)
        _await_loads(procs, loaded_ranks)
        _init(0, n, port, loaded.device)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    group = _current = Group(procs, loaded)
    atexit.register(group.close)
    return loaded, group


def _await_loads(procs: list, loaded_ranks) -> None:
    """Until every spawned rank has loaded its shard: ModelError with its message where its
    load raised one, RankFailed where it failed otherwise or died (SIGKILL, the OOM killer)."""
    waiting = set(range(1, len(procs) + 1))
    while waiting:
        try:
            rank, why = loaded_ranks.get(timeout=0.5)
        except queue.Empty:
            dead = [(r, procs[r - 1].exitcode) for r in sorted(waiting)
                    if procs[r - 1].exitcode is not None]
            if dead:
                r, code = dead[0]
                raise RankFailed(f"engine.tensor_parallel: rank {r} exited with code {code} "
                                 f"while loading its shard; the job stops") from None
            continue
        if why is not None:
            kind, message = why
            raise (ModelError(message) if kind == "ModelError" else RankFailed(
                f"engine.tensor_parallel: rank {rank} failed to load its shard: {message}"))
        waiting.discard(rank)


def share_pool(group: Group, num_pages: int, page_size: int, kv_setting: str) -> None:
    """Tell the ranks the pool's size: the same page ids on every rank."""
    group._collective(_send, ((num_pages, page_size, kv_setting),))
