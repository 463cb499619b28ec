"""A causal LM as a walk-graph model: ``prefill`` (the prompt, one step) then ``decode`` (a
DynamicLoop of one token per step) on a KVCacheEngine; every token is EMITted as it is made.

With ``prefill_samples=False`` the prefill step only fills the cache with ``prompt[:-1]`` and
hands ``prompt[-1]`` to the decode loop, so every generated token comes from the ``decode``
node -- what a model that streams the decode node's tokens into a consumer needs (Orpheus TTS).
A ``logits_processor(state, logits_row) -> logits_row`` reshapes each request's logits before
sampling (constrained decoding); it sees the request's state (``history``, ``generated``...).

    lm = CausalLM.from_pretrained("path/to/llama")       # config.json + safetensors
    with mstar_rt.Runtime(lm) as rt:
        for name, token in rt.submit({"prompt": [1, 2, 3],
                                      "params": SamplingParams(max_tokens=32)}):
            ...
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from mstar_rt.engines.cuda_graphs import DEFAULT_BUCKETS, DecodeGraphs
from mstar_rt.engines.kv_engine import KVCacheEngine, KVNodeSubmodule, KVStep, KVWork
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.engines.sampling import SamplingParams, make_generator, sample
from mstar_rt.graph import EMIT, DynamicLoop, GraphEdge, GraphNode
from mstar_rt.model import Model, RequestContext, WorkContext

LOOP = "generate"

#: ``(request state, logits row [V]) -> logits row [V]``, applied before sampling.
LogitsProcessor = Callable[[dict, torch.Tensor], torch.Tensor]


class LMNode(KVNodeSubmodule):
    """Runs prefill and decode items of many requests in one ragged batch, samples each
    request's next token with its own parameters and generator, and stops its loop on EOS,
    ``max_tokens`` or the maximum sequence length.

    ``prefill_samples=False``: prefill caches ``prompt[:-1]`` and outputs ``prompt[-1]`` as its
    token without sampling (nothing EMITted, no stop); the decode steps make all
    ``max_tokens``. ``logits_processor`` (see :data:`LogitsProcessor`) runs per request on the
    rows that are sampled; emitted ``logits`` are the model's, before it."""

    cleanup_by_cache_id = True  # its request state is in request.state; handoffs by cache_id

    def __init__(self, module: torch.nn.Module, eos_token_ids: Sequence[int], max_seq_len: int,
                 max_batch: int = 64, emit_logits: bool = False, cuda_graphs: bool = False,
                 compile: Union[bool, str] = False, prefill_samples: bool = True,
                 logits_processor: Optional[LogitsProcessor] = None) -> None:
        self.module = module
        self.eos = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self.emit_logits = emit_logits
        self.prefill_samples = prefill_samples
        self.logits_processor = logits_processor
        self.vocab_size = int(module.config.vocab_size)
        tp_size = int(getattr(module, "tp_size", 1))
        if tp_size > 1 and (cuda_graphs or compile):
            raise ValueError(f"cuda_graphs and compile capture the decode step in one process, "
                             f"but this LM is tensor-parallel (tp_size {tp_size}) and runs its "
                             "steps eagerly across processes; drop cuda_graphs / compile")
        # Decode steps through static per-bucket buffers (captured as CUDA graphs on CUDA);
        # compile implies them, since it compiles that static forward.
        self.static_decode = bool(cuda_graphs or compile)
        self.compile = compile
        self._graphs: Optional[DecodeGraphs] = None  # built on the first step (it needs the cache)
        #: Where a decode side finds the handoffs of requests prefilled elsewhere (an object
        #: with ``take(key) -> handoff or None``, e.g. kv_handoff.HandoffTable); None: never.
        self.handoffs: Optional[Any] = None

    def kv_layout(self) -> KVLayout:
        return self.module.kv_layout()

    def check_prompt(self, prompt: Any) -> torch.Tensor:
        ids = prompt_tensor(prompt)
        if ids.numel() == 0:
            raise ValueError("the prompt is empty; give at least one token id")
        if ids.numel() == 1 and not self.prefill_samples:
            raise ValueError("this LM's prefill does not sample (prefill_samples=False): it caches "
                             "all prompt tokens but the last, which starts the decode loop; give "
                             "at least two token ids")
        if ids.numel() >= self.max_seq_len:
            raise ValueError(f"the prompt has {ids.numel()} tokens but the maximum sequence "
                             f"length is {self.max_seq_len} (prompt and at least one new token); "
                             "shorten the prompt")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size}); got "
                             f"{low if low < 0 else high}")
        return ids

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        """A KVWork whose payload is ``(token ids, request state, given)``: ``given`` is the
        token this work outputs without sampling (a non-sampling prefill), else None."""
        state = ctx.request.state
        device = self.module.model.embed_tokens.weight.device
        if "prompt" in inputs:  # prefill
            ids = self.check_prompt(inputs["prompt"])
            params = self.check_params(inputs.get("params"))
            state.update(params=params, generator=make_generator(params, device),
                         history=ids.tolist(), generated=0, done=False)
            given = None
            asked = f"a prompt of {ids.numel()} tokens + max_tokens {params.max_tokens}"
            if not self.prefill_samples:  # the last prompt token is the first decode input
                given, ids = int(ids[-1]), ids[:-1]
            reserve = min(ids.numel() + params.max_tokens, self.max_seq_len)
            if ids.numel() + params.max_tokens > self.max_seq_len:
                asked += f" (capped at max_seq_len {self.max_seq_len})"
            return KVWork(ids.numel(), reserve=reserve, payload=(ids.to(device), state, given),
                          reserve_for=asked, reserve_fix="lower max_tokens or shorten the prompt")
        if "params" not in state and self.handoffs is not None:  # prefill ran elsewhere
            return self.resume(ctx, inputs)
        tok = torch.tensor([int(inputs["token"])], dtype=torch.long, device=device)
        # must_exist: a step whose K/V left (dropped, lost) would decode from an empty cache
        return KVWork(1, payload=(tok, state, None), must_exist=True)

    def resume(self, ctx: WorkContext, inputs: dict) -> KVWork:
        """A request's first decode step after a prefill elsewhere: its handoff (``state``,
        ``kv``), taken from :attr:`handoffs` under ``inputs["handoff"]`` (else the request id),
        restores the state and brings the K/V for the engine to write (``KVWork.kv_import``)."""
        key = inputs.get("handoff", ctx.request.cache_id)
        handoff = self.handoffs.take(key) if self.handoffs is not None else None
        if handoff is None:
            raise KeyError(f"decode of request {ctx.request.id} found no handoff under key "
                           f"{key!r}: its prefill's K/V never arrived here (or were taken)")
        self.resume_state(ctx.request.state, handoff.state)
        work = self.prepare_inputs(ctx, {"token": handoff.state["token"]})
        kv = handoff.kv
        work.reserve = min(max(kv.reserve, kv.length + 1), self.max_seq_len)
        work.kv_import = kv
        return work

    def cleanup(self, request: RequestContext) -> None:
        if self.handoffs is not None:  # a handoff whose decode never started
            self.handoffs.take(request.inputs.get("handoff", request.cache_id))

    def handoff_state(self, state: dict) -> dict:
        """What a decode elsewhere needs of a request's state after prefill, as plain data: the
        next input ``token``, ``params``, ``history``, ``generated`` and the sampling
        generator's ``generator_state`` (bytes, or None when greedy). See :meth:`resume_state`."""
        g = state["generator"]
        return dict(token=int(state["history"][-1]), params=dataclasses.asdict(state["params"]),
                    history=list(state["history"]), generated=int(state["generated"]),
                    generator_state=None if g is None else g.get_state().numpy().tobytes())

    def resume_state(self, state: dict, data: Mapping[str, Any]) -> None:
        """Fills a request's state from :meth:`handoff_state`'s data (on the decode side), so
        its decode steps sample exactly as they would have where the prefill ran."""
        params = dict(data["params"])
        params["stop_token_ids"] = tuple(params.get("stop_token_ids", ()))
        p = self.request_params(params)
        g = make_generator(p, self.module.model.embed_tokens.weight.device)
        if g is not None and data.get("generator_state") is not None:
            g.set_state(torch.frombuffer(bytearray(data["generator_state"]), dtype=torch.uint8))
        state.update(params=p, generator=g, history=list(data["history"]),
                     generated=int(data["generated"]), done=False)

    def request_params(self, params: Any) -> SamplingParams:
        """The request's SamplingParams (a subclass may supply its own defaults)."""
        return as_params(params)

    def check_params(self, params: Any) -> SamplingParams:
        """:meth:`request_params`, with stop tokens checked against the vocabulary (one that
        cannot be made would silently never stop the request)."""
        p = self.request_params(params)
        outside = [t for t in p.stop_token_ids if t >= self.vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids {outside} lie outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return p

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        ids = torch.cat([w.payload[0] for w in works])
        rows = [i for i, w in enumerate(works) if w.payload[2] is None]  # the works that sample
        logits = self._static_decode(ids, step) if self.static_decode else None
        if logits is None:
            hidden = self.module(ids, step)
            last = step.last_token
            logits = self.module.logits(hidden[last if len(rows) == len(works) else last[rows]])
        elif len(rows) < len(works):
            logits = logits[rows]
        out: list[Mapping[str, Any]] = [{"token": w.payload[2]} for w in works]
        if not rows:
            return out
        states = [works[i].payload[1] for i in rows]
        params = [s["params"] for s in states]
        histories = [torch.tensor(s["history"]) if p.repetition_penalty != 1.0 else _EMPTY
                     for s, p in zip(states, params)]
        scores = logits
        if self.logits_processor is not None:
            process = self.logits_processor
            scores = torch.stack([process(s, logits[j]) for j, s in enumerate(states)])
        tokens = sample(scores, params, [s["generator"] for s in states], histories).tolist()
        for j, (i, tok, s) in enumerate(zip(rows, tokens, states)):
            s["history"].append(tok)
            s["generated"] += 1
            o = {"token": tok}
            if self.emit_logits:
                o["logits"] = logits[j].float().cpu()
            out[i] = o
        return out

    def _static_decode(self, ids: torch.Tensor, step: KVStep) -> Optional[torch.Tensor]:
        """Logits from the bucketed static decode path, or None when the step is not a plain
        decode step it serves."""
        steps = step.steps
        if self._graphs is None:
            buckets = [b for b in DEFAULT_BUCKETS if b < self.max_batch] + [self.max_batch]
            self._graphs = DecodeGraphs.for_backend(self.module, step.backend, self.max_seq_len,
                                                    buckets, compile=self.compile)
        out = self._graphs.run(ids, steps)
        return None if out is None else out.logits

    def check_stop(self, works: list[KVWork], outputs: list[Mapping[str, Any]]) -> list:
        stops: list = []
        for w, o in zip(works, outputs):
            s = w.payload[1]
            if w.payload[2] is not None:  # a prefill that sampled nothing cannot stop
                stops.append(())
                continue
            p: SamplingParams = s["params"]
            tok = o["token"]
            done = (s["generated"] >= p.max_tokens or len(s["history"]) >= self.max_seq_len
                    or tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos))
            s["done"] = done
            stops.append((LOOP,) if done else ())
        return stops


_EMPTY = torch.empty(0, dtype=torch.long)


def prompt_tensor(prompt: Any) -> torch.Tensor:
    """A prompt of token ids (a 1-D list, array or tensor of integers) as a long tensor; what
    would be read as something else (text, floats truncated, booleans, a batch of prompts
    flattened into one) is refused by name."""
    if prompt is None or isinstance(prompt, (str, bytes)):
        raise TypeError(f"the prompt must be token ids (a 1-D sequence of integers), not "
                        f"{type(prompt).__name__}; tokenize text first")
    a = None if torch.is_tensor(prompt) else np.asarray(prompt)
    if a is not None and (a.dtype.kind not in "biufc" or a.dtype.kind == "u" and a.size
                          and int(a.max()) >= 2**63):  # None, text, a generator, past int64
        raise TypeError(f"prompt token ids must be integers below 2**63; got {prompt!r:.80}")
    t = prompt if a is None else torch.as_tensor(a.astype(np.int64) if a.dtype.kind == "u" else a)
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"prompt token ids must be integers, got {str(t.dtype)[6:]}")
    if t.dim() != 1:
        raise ValueError(f"the prompt must be 1-D token ids, got shape {list(t.shape)} (give "
                         "each prompt its own request)")
    return t.to(torch.long)


def as_params(p: Union[None, SamplingParams, Mapping[str, Any]]) -> SamplingParams:
    if p is None:
        return SamplingParams()
    if isinstance(p, SamplingParams):
        return p
    if isinstance(p, Mapping):
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(str(k) for k in p if k not in known)
        if unknown:  # Python's own words name one key and not what is allowed
            raise TypeError(f"params {unknown} are not sampling parameters; the fields are "
                            f"{sorted(known)}")
        return SamplingParams(**p)
    raise TypeError(f"params must be SamplingParams or a dict of its fields, not {type(p).__name__}")


class CausalLM(Model):
    """Serves a causal LM module (e.g. :class:`~mstar_rt.models.llama.LlamaForCausalLM`).

    Inputs: ``prompt`` (token ids) and ``params`` (:class:`SamplingParams` or a dict; optional).
    EMITs ``token`` per generated token (and ``logits`` with ``emit_logits``).
    ``cuda_graphs`` runs decode steps through CUDA graphs of batch-size buckets (on the CPU the
    same padded static path runs eagerly, for tests); ``compile`` also ``torch.compile``s it.
    ``prefill_samples`` and ``logits_processor``: see :class:`LMNode`.
    """

    inputs = ("prompt", "params")
    input_defaults = {"params": None}

    def __init__(self, module: torch.nn.Module, eos_token_ids: Sequence[int] = (),
                 max_seq_len: Optional[int] = None, engine: Optional[KVCacheEngine] = None,
                 max_batch: int = 64, emit_logits: bool = False, cuda_graphs: bool = False,
                 compile: Union[bool, str] = False, prefill_samples: bool = True,
                 logits_processor: Optional[LogitsProcessor] = None) -> None:
        max_seq_len = max_seq_len or int(module.config.max_position_embeddings)
        self.module = module.eval()
        self.lm = LMNode(module, eos_token_ids, max_seq_len, max_batch, emit_logits, cuda_graphs,
                         compile, prefill_samples, logits_processor)
        token_out = [GraphEdge(EMIT, "token")] + ([GraphEdge(EMIT, "logits")] if emit_logits else [])
        self.nodes = [
            GraphNode("prefill", ["prompt", "params"],
                      (token_out if prefill_samples else [])
                      + [GraphEdge("decode", "token", persist=True)],
                      submodule=self.lm, engine="lm"),
            GraphNode("decode", ["token"], token_out + ["token"], submodule=self.lm, engine="lm"),
        ]
        self.walks = {"prefill": "prefill",
                      "decode": DynamicLoop("decode", max_seq_len, LOOP)}
        self.engine_specs = {"lm": engine or KVCacheEngine(max_batch=max_batch)}

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        self.lm.check_prompt(inputs["prompt"])
        self.lm.check_params(inputs.get("params"))

    def next_walk(self, request: RequestContext, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        if finished_walk == "prefill" and not request.state.get("done", True):
            return "decode"
        return None

    @staticmethod
    def from_pretrained(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None,
                        device: str = "cpu", progress: bool = True, tp_size: int = 1,
                        tp_restart: str = "auto", expert_parallel: bool = False,
                        **kwargs: Any) -> "CausalLM":
        """Loads a Llama-architecture HF checkpoint directory and serves it. ``tp_size`` > 1
        splits it over that many processes (:func:`~mstar_rt.distributed.llama_tp.load_llama_tp`;
        docs/tensor_parallel.md; ``tp_restart``: its ``restart``); :meth:`close` then stops
        them. (``expert_parallel`` is refused: a Llama has no experts.)"""
        if expert_parallel:
            raise ValueError(f"expert_parallel=True splits a mixture of experts by whole experts "
                             f"(Qwen3-Omni's thinker); the Llama at {os.fspath(path)} has none: "
                             "drop expert_parallel (tp_size alone splits its heads and MLP)")
        if tp_restart not in ("auto", "eager", "manual"):  # (at tp_size 1 it went unread)
            raise ValueError(f"tp_restart must be 'auto', 'eager' or 'manual', not "
                             f"{tp_restart!r}")
        if tp_size != 1:
            from mstar_rt.distributed.llama_tp import load_llama_tp

            module: torch.nn.Module = load_llama_tp(path, tp_size, dtype=dtype, device=device,
                                                    restart=tp_restart)
        else:
            from mstar_rt.models.llama import load_llama

            module = load_llama(path, dtype=dtype, device=device, progress=progress)
        try:
            return CausalLM(module, module.config.eos_token_ids, **kwargs)
        except BaseException:
            close = getattr(module, "close", None)
            if close is not None:  # do not leave followers behind a refused model
                close()
            raise

    def health(self) -> Optional[str]:
        health = getattr(self.module, "health", None)  # a tensor-parallel module's
        return health() if health is not None else None

    def close(self) -> None:
        """Stops the follower processes of a tensor-parallel module (nothing otherwise)."""
        close = getattr(self.module, "close", None)
        if close is not None:
            close()
