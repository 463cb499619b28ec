"""KVCacheEngine: continuous batching over a paged KV cache.

Each step takes every ready item of the engine's nodes (prefill and decode of different requests
alike), admits as many as the pages and the token budget allow, runs them as one ragged batch
(linear layers over all tokens at once, attention per sequence through the backend), and reports
each node's items to the Conductor. Items that do not fit wait for the next step (back-pressure);
a request whose sequence can never fit fails alone with an error that says what to raise.
"""

from __future__ import annotations

import abc
import numbers
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch

from mstar_rt.engines.attention import (
    AttentionBackend, AttentionPlan, StaticDecodeAttention, select_backend)
from mstar_rt.engines.attention_base import SeqStep
from mstar_rt.engines.base import Engine
from mstar_rt.engines.kv_labels import missing_label, needs_label
from mstar_rt.engines.masks import CAUSAL
from mstar_rt.engines.paged_kv import (KVLayout, OutOfPages, PagedKVCache, SequenceKV,
                                       SequenceTooLarge)
from mstar_rt.model import NodeSubmodule
from mstar_rt.request_errors import RequestTooLarge


@dataclass
class KVWork:
    """What one execution of a KV node asks of the engine: ``num_tokens`` new tokens on
    sequence ``label`` of its request, attended with ``mask``; ``persist`` appends their K/V
    (else they read the cached prefix and vanish after the step). A missing label is created
    empty, or as a fork of ``fork_from``. ``reserve`` is the length the sequence may grow to:
    the engine admits it only when that many tokens' pages are free. ``payload`` is the
    submodule's own data (token ids, embeddings, sampling state). ``kv_import``: the label's
    K/V made elsewhere (another process's prefill); the engine writes it into its own pages
    before the work's tokens, once, when the label does not exist yet. ``reserve_for`` says
    what ``reserve`` counts in the request's own terms, and ``reserve_fix`` how the request could
    ask for less: the words of its error when the cache can never hold it. ``must_exist``:
    True fails the request when the label is missing (a decode step, a read of a prefix);
    False lets a read of a missing label attend over nothing; None (the default) creates a
    persisting work's label and fails a read of a missing label (see engines/kv_labels.py)."""

    num_tokens: int
    label: str = "main"
    persist: bool = True
    mask: object = CAUSAL
    fork_from: Optional[str] = None
    reserve: int = 0
    payload: Any = None
    kv_import: Optional[SequenceKV] = None
    reserve_for: str = ""  # e.g. "a prompt of 12 tokens + max_tokens 500"
    reserve_fix: str = "shorten the request"
    must_exist: Optional[bool] = None


class KVStep:
    """What ``forward_kv`` gets: the step's sequences, positions of the new tokens and attention
    per layer. The backend's plan is built on first use, so a step served another way (a
    captured CUDA graph) does not pay for it."""

    def __init__(self, backend: Union[AttentionBackend, StaticDecodeAttention],
                 steps: Union[list[SeqStep], tuple[SeqStep, ...], AttentionPlan]) -> None:
        """``steps``: the step's :class:`SeqStep` list, or a plan the backend already built (a
        static decode step comes with its plan, and ``backend`` is then its static attention)."""
        self.backend = backend
        self._plan: Optional[AttentionPlan]
        if isinstance(steps, (list, tuple)):
            self.steps, self._plan = list(steps), None
        else:
            self.steps, self._plan = list(getattr(steps, "steps", ())), steps

    @property
    def plan(self) -> AttentionPlan:
        if self._plan is None:
            self._plan = self.backend.plan(self.steps)
        return self._plan

    @property
    def positions(self) -> torch.Tensor:
        """``[T]``: positions of the new tokens, work after work."""
        return self.plan.positions

    @property
    def last_token(self) -> torch.Tensor:
        """``[B]``: index of each work's last new token among the ``T``."""
        return self.plan.last_token

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: Optional[float] = None) -> torch.Tensor:
        return self.backend.attend(layer, q, k, v, self.plan, scale)


class KVNodeSubmodule(NodeSubmodule):
    """A node whose module attends over the engine's paged KV cache.

    :meth:`prepare_inputs` returns a :class:`KVWork`; :meth:`forward_kv` runs a batch of works
    whose new tokens lie flat, work after work, in ``step.positions``.
    """

    max_batch = 64

    @abc.abstractmethod
    def kv_layout(self) -> KVLayout:
        """Layers, KV heads, head size, dtype and device of the cache this module needs."""

    @abc.abstractmethod
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        """Runs the works; returns, per work, the node's outputs by name."""

    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        raise TypeError(f"{type(self).__name__} attends over a KV cache; map its nodes to a "
                        "KVCacheEngine in the model's engine_specs")


class KVCacheEngine(Engine):
    """Serves :class:`KVNodeSubmodule` nodes with a paged KV cache and continuous batching.

    ``page_size`` tokens per page, ``num_pages`` pages (per layer, K and V);
    ``max_tokens_per_step`` bounds a step's new tokens (long prompts are not split: one prompt
    may exceed it alone). ``attention_backend``: ``"torch"``, ``"flashinfer"`` (CUDA) or
    ``"auto"`` (FlashInfer when it is installed and the cache is on CUDA in fp16/bf16).
    ``num_threads``: torch intra-op threads on the worker; ``"auto"`` is 1 for a cache on a CPU
    with at most 4 cores (where a worker thread's OpenMP pool costs more than it gives, see
    docs/engines.md), else torch's setting; None leaves torch's setting.
    """

    keys_by_cache_id = True  # pages are kept per RequestContext.cache_id

    def __init__(self, page_size: int = 16, num_pages: int = 1024, max_batch: int = 64,
                 max_tokens_per_step: int = 4096, attention_backend: str = "auto",
                 num_threads: Union[int, str, None] = "auto") -> None:
        for name, value in (("page_size", page_size), ("num_pages", num_pages),
                            ("max_batch", max_batch), ("max_tokens_per_step", max_tokens_per_step)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                # max_batch=0 took no work at all: every request hung
                raise ValueError(f"KVCacheEngine {name}={value!r}; give an integer >= 1")
        super().__init__(None if num_threads == "auto" else num_threads)
        #: num_threads="auto": one intra-op thread on a small CPU machine, else torch's default.
        self.auto_threads = num_threads == "auto"
        self.page_size, self.num_pages = page_size, num_pages
        self._max_batch, self.max_tokens_per_step = max_batch, max_tokens_per_step
        self.attention_backend = attention_backend
        self.cache: Optional[PagedKVCache] = None
        self.backend: Optional[AttentionBackend] = None
        self.steps = 0
        self._cids: dict[int, int] = {}  # work item -> its cache id, read while it was live
        self.step_sizes: list[int] = []  # items per step (recent window) for tests and stats

    # ---- setup -------------------------------------------------------------------------------

    def attach(self, host: Any, engine_id: int, name: str, nodes: Any) -> None:
        super().attach(host, engine_id, name, nodes)
        layouts = set()
        for sub in host.nodes.unique_submodules(nodes):
            if not isinstance(sub, KVNodeSubmodule):
                raise TypeError(f"engine '{name}' is a KVCacheEngine but serves "
                                f"{type(sub).__name__}, which is not a KVNodeSubmodule; map that "
                                "node to another engine")
            layouts.add(sub.kv_layout())
        if len(layouts) != 1:
            raise ValueError(f"the nodes of KV engine '{name}' need different cache layouts "
                             f"{sorted(map(str, layouts))}; give each layout its own engine")
        self.cache = PagedKVCache(layouts.pop(), self.page_size, self.num_pages)
        if self.auto_threads:
            on_cpu = torch.device(self.cache.layout.device).type == "cpu"
            self.num_threads = 1 if on_cpu and (os.cpu_count() or 1) <= 4 else None
        self.backend = select_backend(self.attention_backend, self.cache)

    @property
    def max_batch(self) -> int:
        return self._max_batch

    def release(self, request_id: int) -> None:
        if self.cache is not None:
            self.cache.release(request_id)

    # ---- KV transfer (prefill here, decode elsewhere) ----------------------------------------

    def export_request(self, request_id: int, label: str = "main", free: bool = False,
                       device: Optional[str] = None) -> SequenceKV:
        """A copy of the request's cached K/V on ``label`` (see
        :meth:`PagedKVCache.export_sequence`); ``free`` drops the label's pages afterwards.
        Call it when no work of the request is in flight (e.g. at a walk's end: in
        ``Model.next_walk``)."""
        kv = self.attached_cache().export_sequence(request_id, label, device)
        if free:
            self.attached_cache().drop(request_id, label)
        return kv

    def import_request(self, request_id: int, kv: SequenceKV, label: str = "main",
                       reserve: int = 0) -> None:
        """Writes ``kv`` into pages of this engine's cache as the request's ``label``, now.
        For a request not yet submitted here, or with no work in flight; a request that starts
        with it gives it in its first :class:`KVWork` (``kv_import``) instead. Raises
        :class:`OutOfPages` when the pages are not free (nothing is taken)."""
        cache = self.attached_cache()
        if cache.import_sequence(request_id, label, kv, reserve) is None:
            need = -(-max(reserve, kv.reserve, kv.length) // cache.page_size)
            raise OutOfPages(f"the KV cache of engine '{self.name}' cannot take {kv.length} "
                             f"tokens (reserving {need} pages of {cache.page_size}) now: "
                             f"{cache.free_pages} of {cache.num_pages} pages are free and some "
                             "are promised to running requests; retry when requests end, or "
                             "raise num_pages")

    def attached_cache(self) -> PagedKVCache:
        if self.cache is None:
            raise RuntimeError(f"KV engine '{self.name}' has no cache yet: it gets one when a "
                               "Runtime attaches it")
        return self.cache

    # ---- the worker loop ---------------------------------------------------------------------

    def serve(self) -> None:
        host = self.host
        assert host is not None
        self.init_worker_thread()
        pending: list[tuple[int, tuple, KVWork]] = []  # (node, item, work) waiting for pages
        while not host.closed:
            fresh = self._take(short_wait=bool(pending))
            for node, item in fresh:
                work = self._prepare(node, item)
                if work is not None:
                    pending.append((node, item, work))
            if not pending:
                continue
            try:
                chosen, pending = self._schedule(pending)
                if chosen:
                    self._run_step(chosen)
                else:
                    time.sleep(0.002)  # waiting for another request to end and free pages
                if len(self._cids) > 2 * len(pending) + 64:  # those of items gone
                    self._cids = {it.id: self._cids[it.id] for _n, it, _w in pending
                                  if it.id in self._cids}
            except Exception as e:  # a bug here must not strand items: fail what was in hand
                traceback.print_exc()
                self._fail([item.id for _n, item, _w in pending],
                           f"KV engine '{self.name}' failed: {type(e).__name__}: {e}")
                pending = []

    def _take(self, short_wait: bool) -> list[tuple[int, tuple]]:
        host = self.host
        queue, engine = host.queue, self.engine_id
        taken: list[tuple[int, tuple]] = []
        timeout = 0.0 if short_wait else host.poll_s
        while len(taken) < self._max_batch:
            batch = queue.next_batch(engine, self._max_batch - len(taken), timeout)
            if batch is None:
                break
            node, _walk, items = batch
            taken.extend((node, it) for it in items)
            timeout = 0.0  # drain what else is ready (other nodes: prefill beside decode)
        return taken

    def _prepare(self, node: int, item: tuple) -> Optional[KVWork]:
        host = self.host
        try:
            work = host.runner.prepare(node, [item], True)[0]
            if not isinstance(work, KVWork):
                raise TypeError(f"{type(host.nodes[node].submodule).__name__}.prepare_inputs returned "
                                f"{type(work).__name__}; a KV node must return a KVWork")
            if work.num_tokens < 1:
                raise ValueError(f"a KVWork needs at least one new token (got {work.num_tokens})")
            self._cids[item.id] = self._cache_id(item.request)
            return work
        except Exception as e:
            self._fail([item.id], f"{type(e).__name__}: {e}")
            return None

    def _fail(self, ids: list[int], message: str) -> None:
        host = self.host
        try:
            host.report(host.queue.fail_items(ids, message))
        except Exception:
            traceback.print_exc()

    def _schedule(self, pending: list) -> tuple[list, list]:
        """Splits pending works into this step's (admitted, with their SeqStep) and the rest."""
        cache = self.cache
        chosen, waiting = [], []
        keys: set[tuple[int, str]] = set()
        tokens = 0
        for node, item, work in pending:
            rid = self._cid(item)
            if not self._live(item.request):  # ended while it waited: the item is done
                self._fail([item.id], "request ended")
                cache.release(rid)
                continue
            key = (rid, work.label)
            if key in keys or (chosen and tokens + work.num_tokens > self.max_tokens_per_step):
                waiting.append((node, item, work))
                continue
            try:
                if work.kv_import is not None and cache.sequence(rid, work.label) is None:
                    reserve = max(work.reserve, work.kv_import.length + work.num_tokens)
                    if cache.import_sequence(rid, work.label, work.kv_import, reserve) is None:
                        waiting.append((node, item, work))  # its pages are not free yet
                        continue
                if (work.fork_from is None and cache.sequence(rid, work.label) is None
                        and needs_label(work.must_exist, work.persist)):
                    # its pages go when its request ends, as the failure ends it
                    self._fail([item.id], missing_label(
                        self.host.nodes[node].name, self.name, work.label, work.persist,
                        cache.labels(rid), cache.dropped_labels(rid)))
                    continue
                if work.persist:
                    seq = cache.admit(rid, work.label, work.num_tokens, work.reserve,
                                      work.fork_from)
                elif work.fork_from is not None and cache.sequence(rid, work.label) is None:
                    seq = cache.admit(rid, work.label, 0, 0, work.fork_from)
                else:
                    seq = cache.sequence(rid, work.label)
            except SequenceTooLarge as e:  # never: the request fails alone, holding nothing
                self._fail([item.id], too_large(e, work))
                continue
            except (OutOfPages, KeyError, ValueError) as e:
                self._fail([item.id], str(e).strip("'\""))
                continue
            if seq is None and work.persist:
                waiting.append((node, item, work))
                continue
            cached = seq.length if seq is not None else 0
            pages = list(seq.pages) if seq is not None else []
            keys.add(key)
            tokens += work.num_tokens
            chosen.append((node, item, work,
                           SeqStep(cached, work.num_tokens, pages, work.persist, work.mask)))
        # A cancel that raced the admissions above released the request before (or while) its
        # pages were taken: give them back now, before any K/V is written.
        for entry in [c for c in chosen if not self._live(c[1].request)]:
            chosen.remove(entry)
            cache.release(self._cid(entry[1]))
            self._fail([entry[1].id], "request ended")
        if not chosen and waiting and self._stuck(waiting):
            node, item, work = waiting.pop()  # the youngest waiter gives way
            self._fail([item.id], (
                f"the KV cache is full ({cache.num_pages} pages of {cache.page_size} tokens) and "
                "every request holding pages is waiting for more; raise num_pages, or lower "
                "max_batch / the requests' reserve"))
            cache.release(self._cid(item))
        return chosen, waiting

    def _live(self, rid: int) -> bool:
        return self.host.requests.knows(rid)

    def _cid(self, item: Any) -> int:
        """The cache id of a work item's request, as it was when the item was prepared: once
        the request is gone its context is (a borrowed cache id would read as its own id, and
        its pages be missed)."""
        cid = self._cids.get(item.id)
        return cid if cid is not None else self._cache_id(item.request)

    def _cache_id(self, rid: int) -> int:
        """The id the cache keeps request ``rid``'s pages under (RequestContext.cache_id)."""
        requests = self.host.requests
        entry = requests.get(rid)  # else submit may not have registered it yet: ask under lock
        cache_id = (entry.context if entry is not None else requests.context(rid)).cache_id
        return cache_id if cache_id >= 0 else rid

    def _stuck(self, waiting: list) -> bool:
        """True when no request outside ``waiting`` holds pages, so none will free any."""
        waiting_rids = {self._cid(item) for _n, item, _w in waiting}
        return self.cache.holders() <= waiting_rids

    def _run_step(self, chosen: list) -> None:
        nodes = self.host.nodes
        self.steps += 1
        self.step_sizes.append(len(chosen))
        if len(self.step_sizes) > 4096:
            del self.step_sizes[:2048]
        groups: dict[int, list] = {}
        for entry in chosen:
            groups.setdefault(id(nodes[entry[0]].submodule), []).append(entry)
        for group in groups.values():
            try:
                results = self._forward(group)
            except Exception as e:
                if len(group) == 1:  # the culprit is known: running it again repeats its work
                    self._report([(group[0], None, f"{type(e).__name__}: {e}")])
                    continue
                # isolate: one by one, so only the culprit's request fails
                results = []
                for entry in group:
                    try:
                        results.extend(self._forward([entry]))
                    except Exception as e:
                        results.append((entry, None, f"{type(e).__name__}: {e}"))
            self._report(results)

    def _forward(self, group: list) -> list:
        entry, cache = self.host.nodes[group[0][0]], self.cache
        sub = entry.submodule
        works = [w for _n, _i, w, _s in group]
        outputs = sub.forward_kv(works, KVStep(self.backend, [s for *_x, s in group]))
        if len(outputs) != len(works):
            raise RuntimeError(f"{type(sub).__name__}.forward_kv returned {len(outputs)} results "
                               f"for {len(works)} works")
        stops: list = [()] * len(works)
        if entry.stops:
            try:
                stops = list(sub.check_stop(works, outputs))
            except Exception:
                # forward_kv ran for the whole step (a stateful node's state has moved on): only
                # check_stop is asked again, item by item, so the culprit fails alone and its
                # batch-mates do not run twice
                stops = [self._stop_of(sub, w, o) for w, o in zip(works, outputs)]
        for _n, item, work, _s in group:
            if work.persist:
                cache.commit(self._cid(item), work.label, work.num_tokens)
        return [(entry, None, f"{type(stop).__name__}: {stop}") if isinstance(stop, Exception)
                else (entry, outputs[i], stop) for i, (entry, stop) in enumerate(zip(group, stops))]

    @staticmethod
    def _stop_of(sub: Any, work: KVWork, output: Any) -> Any:
        """One item's check_stop answer, or the exception it raised."""
        try:
            return sub.check_stop([work], [output])[0]
        except Exception as e:
            return e

    def _report(self, results: list) -> None:
        host = self.host
        by_node: dict[int, tuple[list, list, list]] = {}
        for (node, item, _w, _s), out, extra in results:
            if out is None:
                self._fail([item.id], extra)
                continue
            try:
                stop_ids = [host.loop_id(s) for s in extra]
            except Exception as e:
                self._fail([item.id], str(e))
                continue
            ids, outs, stops = by_node.setdefault(node, ([], [], []))
            ids.append(item.id)
            outs.append(out)
            stops.append(stop_ids)
        for node, (ids, outs, stops) in by_node.items():
            try:
                host.report(host.queue.complete(node, ids, outs, stops))
            except Exception as e:
                self._fail(ids, f"{type(e).__name__}: {e}")


def too_large(e: SequenceTooLarge, work: KVWork) -> str:
    """The failure message of a work whose sequence the cache can never hold, tagged so that its
    request ends with :class:`~mstar_rt.request_errors.RequestTooLarge` (HTTP 400)."""
    what = work.reserve_for or f"a sequence of {e.tokens} tokens"
    return (f"{RequestTooLarge.TAG}{what} needs {e.pages} pages of {e.page_size} tokens but the "
            f"KV cache has {e.num_pages}; raise num_pages to {e.pages} or more "
            f"(kv_cache.num_pages in a serving config) or page_size, or {work.reserve_fix}")
