"""The replica engine: one model, one block pool, one prefix cache, one thread.

Callers (the server's event loop, tests, benchmarks) talk to the engine only through
thread-safe methods: ``submit`` validates and queues a request and returns a
``RequestHandle`` to stream from; ``cancel`` asks for a request to end. All model work
happens on the engine thread, which loops: take new requests and cancellations, run one
scheduler step, repeat; it sleeps on a condition variable when idle.

No request can stop the engine: the scheduler fails a request whose handling raises and a
step whose forward raises, and a step that raises anywhere else fails every request in
the scheduler, after which the block bookkeeping is checked. Only when that check (or
anything outside a step) fails does the thread die: then ``submit`` raises
``EngineStopped``, every request in flight or queued ends with an error, and the
callbacks given to ``on_death`` run, so the server can exit and be restarted.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

from replica.config import EngineConfig
from replica.detokenize import TokenDecoder
from replica.handle import RequestHandle
from replica.prefix_cache import CacheListener, CacheStats, PrefixCache
from replica.request import (
    EngineStopped,
    PromptTooLong,
    QueueFull,
    RequestOutput,
    RequestState,
    SamplingParams,
)
from replica.runner import EngineBackend
from replica.scheduler import Scheduler, SchedulerConfig
from router.protocol import ReplicaLoad

log = logging.getLogger("prefixgate.replica.engine")

IDLE_WAIT_S = 0.5  # an idle loop still wakes this often to refresh its heartbeat


class EngineTokenizer(TokenDecoder, Protocol):
    @property
    def eos_token_ids(self) -> Sequence[int]: ...


class EngineModel(Protocol):
    """What the engine needs of a model (``replica.models.LoadedModel``, or the simulated
    engine's ``replica.sim.model.SimModel``); the step itself is the backend's."""

    @property
    def name(self) -> str: ...
    @property
    def tokenizer(self) -> EngineTokenizer: ...
    @property
    def max_context(self) -> int: ...


class Engine:
    def __init__(
        self,
        model: EngineModel,
        config: EngineConfig | None = None,
        listener: CacheListener | None = None,
        backend: EngineBackend | None = None,
    ) -> None:
        """``backend`` computes the steps (``replica.runner``); by default the built-in
        one for ``model``, a loaded transformers model (imported here: it needs torch)."""
        self.model = model
        self.config = config = config or EngineConfig()
        if backend is None:
            from replica.torch_backend import TorchBackend

            backend = TorchBackend(model, config)  # type: ignore[arg-type]
        self.backend = backend
        self.pool = backend.pool
        # A backend with a host tier offers its tensors as ``host_pool`` (a BlockMover).
        host_pool = getattr(backend, "host_pool", None)
        if config.host_cache_mb and host_pool is None:
            raise ValueError(f"the {type(backend).__name__} backend has no host cache tier")
        self.cache = PrefixCache(
            self.pool.num_blocks,
            config.block_size,
            model.name,
            eviction_policy=config.eviction_policy,
            ttl_s=config.ttl_s,
            listener=listener,
            host_blocks=host_pool.num_blocks if host_pool is not None else 0,
            mover=host_pool,
        )
        self._eos = frozenset(model.tokenizer.eos_token_ids)
        self.scheduler = Scheduler(
            self.cache,
            self.pool,
            backend.forward,
            SchedulerConfig(config.max_prefill_tokens_per_step, config.max_running),
            max_context=model.max_context,
            runner=backend.runner,
        )
        self._lock = threading.Condition()
        self._inbox: list[RequestState] = []  # guarded by _lock
        self._cancels: list[str] = []  # guarded by _lock
        self._resets: list[concurrent.futures.Future[int]] = []  # guarded by _lock
        self._num_waiting = 0  # inbox + scheduler queue, guarded by _lock
        self._stopping = False
        self._busy = False  # the engine thread is working on something (under _lock)
        self._thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()
        self._load = ReplicaLoad(
            total_blocks=self.pool.num_blocks, free_blocks=self.pool.num_blocks
        )
        self._stats = self.cache.stats()
        self.error: BaseException | None = None  # what killed the loop, if anything
        self._death_callbacks: list[Callable[[BaseException], None]] = []  # under _lock

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="prefixgate-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left (finish_reason "abort") and join the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (on the engine thread) if the engine thread dies; at
        once if it already has."""
        with self._lock:
            error = self.error
            if error is None:
                self._death_callbacks.append(callback)
        if error is not None:
            callback(error)

    @property
    def alive(self) -> bool:
        thread = self._thread
        recent = time.monotonic() - self._heartbeat < self.config.heartbeat_timeout_s
        return thread is not None and thread.is_alive() and recent

    # ------------------------------------------------------------------------- callers

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        salt: str = "",
        request_id: str | None = None,
    ) -> RequestHandle:
        params.validate()
        wants_logprobs = params.logprobs is not None or params.prompt_logprobs is not None
        if wants_logprobs and not self.backend.has_logits:
            raise ValueError(
                "log probabilities are not available: this replica's engine computes no "
                "logits (the simulated engine); leave logprobs out"
            )
        if params.grammar is not None and not self.backend.has_logits:
            raise ValueError(
                "structured output is not available: this replica's engine computes no "
                "logits to constrain (the simulated engine)"
            )
        self._check_prompt(len(prompt_token_ids))
        vocab = self._vocab_size  # once: the config's attribute lookup is slow
        if prompt_token_ids and not 0 <= min(prompt_token_ids) <= max(prompt_token_ids) < vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id or uuid.uuid4().hex
        handle = RequestHandle(request_id, len(prompt_token_ids))
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        state = RequestState(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            salt=salt,
            stop_token_ids=frozenset(stop_ids),
            sink=handle,
            submitted_at=time.monotonic(),
        )
        with self._lock:
            if self.error is not None:
                raise EngineStopped(
                    f"the engine stopped after an internal error ({type(self.error).__name__})"
                )
            if self._stopping:
                raise EngineStopped("the engine is stopping")
            if self._num_waiting >= self.config.max_waiting:
                raise QueueFull(
                    f"{self._num_waiting} requests are waiting (max_waiting="
                    f"{self.config.max_waiting}); retry later"
                )
            self._num_waiting += 1
            self._inbox.append(state)
            self._lock.notify_all()
        return handle

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.append(request_id)
            self._lock.notify_all()

    def reset_prefix_cache(self) -> concurrent.futures.Future[int]:
        """Drop every cached block (the engine thread does it between steps); the future
        gives how many were freed. Blocks running requests hold leave the index and are
        freed when those finish, so nothing in flight loses its KV."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if self._stopping or not self.alive:
                raise EngineStopped("the engine is not running")
            self._resets.append(future)
            self._lock.notify_all()
        return future

    def load(self) -> ReplicaLoad:
        with self._lock:
            snapshot = ReplicaLoad(**{f: getattr(self._load, f) for f in self._load.__slots__})
            snapshot.waiting = max(snapshot.waiting, self._num_waiting)
        return snapshot

    def cache_stats(self) -> CacheStats:
        """The cache's stats as of the last step (safe from any thread)."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, salt: str = ""
    ) -> RequestOutput:
        """Submit and wait (the engine must be started). For tests and benchmarks."""
        return self.submit(prompt_token_ids, params, salt=salt).wait()

    def run_until_idle(self, timeout: float | None = None) -> None:
        """Block until nothing is queued or running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._inbox or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("engine still busy")
                self._lock.wait(left if left is not None else IDLE_WAIT_S)

    # ------------------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        try:
            with self.backend.thread_context():
                while self._iterate():
                    pass
        except BaseException as exc:
            log.critical("the engine thread died; failing every request", exc_info=exc)
            self._die(exc)
        finally:
            with self._lock:
                self._busy = False
                for future in self._resets:  # nobody is left to do them
                    future.set_exception(EngineStopped("the engine stopped"))
                self._resets.clear()
                self._lock.notify_all()

    def _die(self, exc: BaseException) -> None:
        """Refuse new requests, end every known one with an error, tell the callbacks."""
        with self._lock:
            self.error = exc
            inbox, self._inbox = self._inbox, []
            callbacks, self._death_callbacks = self._death_callbacks, []
        try:
            self.scheduler.fail_all(exc, "running the engine", release=False)
        except Exception:
            log.exception("could not end every running request")
        now = time.monotonic()
        for state in inbox:
            state.error = f"the replica stopped before serving this request ({type(exc).__name__})"
            state.finished_at = now
            state.sink.close(state.output())
        for callback in callbacks:
            try:
                callback(exc)
            except Exception:
                log.exception("an engine death callback failed")

    def _iterate(self) -> bool:
        with self._lock:
            self._heartbeat = time.monotonic()
            idle = not (self._inbox or self._cancels or self._resets or self.scheduler.has_work)
            if idle and not self._stopping:
                self._busy = False
                self._lock.notify_all()
                self._lock.wait(IDLE_WAIT_S)
                return True
            stopping = self._stopping
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            resets, self._resets = self._resets, []
            self._busy = True
        for future in resets:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.cache.clear())
                except BaseException as exc:  # the caller hears of it; the loop dies of it
                    future.set_exception(exc)
                    raise
        for state in inbox:
            self.scheduler.add(state, self.model.tokenizer)
        for request_id in cancels:
            self.scheduler.abort(request_id)
        if stopping:
            self.scheduler.abort_all()
            self._publish()
            return False
        try:
            self.scheduler.step()
        except Exception as exc:
            # Not one request's fault, or not attributable: fail them all, then make sure
            # the blocks add up before going on (if not, the loop dies of it).
            self.scheduler.fail_all(exc, "scheduling a step")
            self.scheduler.check_invariants()
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        self._publish()
        return True

    def _publish(self) -> None:
        sched = self.scheduler
        stats = self.cache.stats()
        running = {s.request.request_id for s in sched.running}
        waiting = {s.request.request_id for s in sched.waiting} - running
        with self._lock:
            self._num_waiting = len(waiting) + len(self._inbox)
            self._stats = stats
            self._load = ReplicaLoad(
                running=len(running),
                waiting=len(waiting),
                free_blocks=stats.free_blocks,
                used_blocks=stats.used_blocks,
                total_blocks=stats.total_blocks,
                queued_prefill_tokens=sched.queued_prefill_tokens,
            )

    # ------------------------------------------------------------------------- checks

    @property
    def _vocab_size(self) -> int:
        return self.backend.vocab_size

    def _check_prompt(self, n: int) -> None:
        if n < 1:
            raise ValueError("the prompt must contain at least one token")
        limit = self.model.max_context
        if n + 1 > limit:
            raise PromptTooLong(
                f"the prompt has {n} tokens but this model's context is {limit} tokens "
                f"(prompt plus at least one generated token); shorten the prompt"
            )
        bs = self.pool.block_size
        # +1 generated token, +1 block for a copy-on-write of a shared partial block
        if math.ceil((n + 1) / bs) + 1 > self.pool.num_blocks:
            capacity = (self.pool.num_blocks - 1) * bs - 1
            raise PromptTooLong(
                f"the prompt has {n} tokens but this replica's KV pool holds at most "
                f"{capacity} prompt tokens ({self.pool.num_blocks} blocks of {bs}); "
                "shorten the prompt or give the replica a larger KV cache"
            )
