"""The agent's response node as an LM walk: a Llama-family chat checkpoint answers what was heard.

:class:`LMResponder` loads a Hugging Face checkpoint directory (``config.json``, safetensors,
``tokenizer.json`` + ``tokenizer_config.json``) with :func:`mstar_rt.models.llama.load_llama`
and the tokenizer through transformers' ``AutoTokenizer`` (local files only). Given to
:class:`~mstar_rt.audio.agent.ReplyModel` as the responder, the reply walk becomes

    reply:  asr -> chat (prompt ids) -> prefill (KV engine "lm")
    speak:  Parallel(DynamicLoop(decode), split, DynamicLoop(tts))

``decode`` streams each token through ``Fixed(1)`` chunks into ``split``
(:class:`SentenceSplitter`), which detokenizes, cuts complete sentences and queues them for the
``tts`` loop: the first sentence is spoken while the LM is still writing the next. Generation
stops at EOS, at a newline (any token whose text holds one) or after ``max_new_tokens``.
Called as a plain function (``responder(text) -> str``, the agent's sequential baseline) it
serves the same module as a :class:`~mstar_rt.models.causal_lm.CausalLM` on its own Runtime.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from mstar_rt.audio.tts import split_sentences
from mstar_rt.model import NodeSubmodule, StreamChunk, WorkContext

# A sentence is complete once whitespace follows its final mark (as tts.split_sentences cuts).
_BOUNDARY = re.compile(r"(?<=[.!?;])\s+")


def load_tokenizer(path: Union[str, os.PathLike]) -> Any:
    """transformers' fast tokenizer of a local checkpoint directory (never the network)."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        # tokenizer_config.json is optional (it carries the chat template and special tokens).
        raise FileNotFoundError(f"{path} has no tokenizer.json: the LM responder needs the "
                                "checkpoint's tokenizer files (tokenizer.json and "
                                "tokenizer_config.json, as save_pretrained writes them)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _eos_ids(path: str, config_eos: Sequence[int], tokenizer: Any) -> tuple[int, ...]:
    """EOS from config.json, generation_config.json (instruct models put their end-of-turn ids
    there) and the tokenizer."""
    ids = set(config_eos)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


class LMResponder:
    """``LMResponder(checkpoint_dir, max_new_tokens=48, temperature=0.0, ...)``.

    ``temperature`` 0 is greedy; otherwise ``top_p`` / ``top_k`` sampling with ``seed``.
    ``system`` is a system message (chat template only). ``max_context`` caps the sequence
    length (prompt + reply) and sizes the KV cache: ``pages`` sequences of it fit at once.
    """

    is_lm = True  # ReplyModel builds the LM reply walk for responders that say so

    def __init__(self, checkpoint_dir: Union[str, os.PathLike], max_new_tokens: int = 48,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: Optional[int] = None, system: Optional[str] = None,
                 stop_at_newline: bool = True, dtype: Any = None, device: str = "cpu",
                 max_context: int = 1024, page_size: int = 16, sequences: int = 2,
                 progress: bool = False) -> None:
        from mstar_rt.engines.sampling import SamplingParams
        from mstar_rt.models.llama import load_llama

        path = os.fspath(checkpoint_dir)
        if not os.path.exists(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} has no config.json: give a Llama-family Hugging "
                                    "Face checkpoint directory (config.json, model.safetensors, "
                                    "tokenizer.json, tokenizer_config.json)")
        self.path, self.system = path, system
        self.tokenizer = load_tokenizer(path)
        self.module = load_llama(path, dtype=dtype, device=device, progress=progress)
        vocab = int(self.module.config.vocab_size)
        self.max_seq_len = min(int(self.module.config.max_position_embeddings), max_context)
        self.page_size, self.sequences = page_size, sequences
        self.eos_ids = _eos_ids(path, self.module.config.eos_token_ids, self.tokenizer)
        self.stop_at_newline = stop_at_newline
        self.stop_ids: tuple[int, ...] = ()
        if stop_at_newline:
            n = min(vocab, len(self.tokenizer))
            texts = self.tokenizer.batch_decode([[i] for i in range(n)])
            self.stop_ids = tuple(i for i, t in enumerate(texts) if "\n" in t)
        self.params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, top_k=top_k, seed=seed,
                                     stop_token_ids=self.stop_ids)
        self._runtime: Any = None
        self._lock = threading.Lock()

    # ---- text <-> ids ------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, text: str) -> list[int]:
        """The prompt for what the user said: the tokenizer's chat template with a generation
        prompt when it has one, else ``"User: {text}\\nAssistant:"``."""
        if self.has_chat_template:
            messages = ([{"role": "system", "content": self.system}] if self.system else [])
            messages.append({"role": "user", "content": text})
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=True)
            # The template writes the special tokens (bos included) itself.
            ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(f"User: {text}\nAssistant:", add_special_tokens=True)
        if len(ids) + 1 >= self.max_seq_len:
            raise ValueError(f"the prompt for {text[:40]!r}... has {len(ids)} tokens but the LM "
                             f"responder's context is {self.max_seq_len}; raise max_context")
        return list(ids)

    def text_of(self, ids: Sequence[int]) -> str:
        """The reply text of generated ids: special tokens dropped, cut at the first newline
        (with ``stop_at_newline``; a token may hold text before its newline)."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text.split("\n", 1)[0] if self.stop_at_newline else text

    # ---- walk parts ---------------------------------------------------------------------------

    def lm_node(self) -> Any:
        """The prefill/decode submodule: prefill caches the prompt but its last token, so every
        reply token comes out of the decode node (the one that streams)."""
        from mstar_rt.models.causal_lm import LMNode

        return LMNode(self.module, self.eos_ids, self.max_seq_len, max_batch=8,
                      prefill_samples=False)

    def engine(self) -> Any:
        """A fresh KVCacheEngine sized for ``sequences`` sequences of ``max_context``."""
        from mstar_rt.engines.kv_engine import KVCacheEngine

        pages = self.sequences * -(-self.max_seq_len // self.page_size)
        return KVCacheEngine(page_size=self.page_size, num_pages=pages, max_batch=8)

    # ---- plain calls ---------------------------------------------------------------------------

    def generate_ids(self, text: str, timeout: float = 120.0) -> list[int]:
        """The reply's token ids (stop token included), from a CausalLM walk on this responder's
        own Runtime (made on first use)."""
        with self._lock:
            if self._runtime is None:
                from mstar_rt.models.causal_lm import CausalLM
                from mstar_rt.runtime import Runtime

                lm = CausalLM(self.module, self.eos_ids, self.max_seq_len, engine=self.engine(),
                              max_batch=8, prefill_samples=False)
                self._runtime = Runtime(lm, poll_s=0.01)
        got = self._runtime.submit({"prompt": self.prompt_ids(text), "params": self.params})
        return [int(t) for t in got.result(timeout=timeout).get("token", [])]

    def __call__(self, text: str) -> str:
        return self.text_of(self.generate_ids(text)).strip()

    def close(self) -> None:
        with self._lock:
            if self._runtime is not None:
                self._runtime.close()
                self._runtime = None


# ---- nodes of the LM reply walk -------------------------------------------------------------

class ChatPrompt(NodeSubmodule):
    """``text`` (the recognition) -> ``prompt`` (token ids) and ``params``."""

    max_batch = 8

    def __init__(self, responder: LMResponder) -> None:
        self.responder = responder

    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        r = self.responder
        return [{"prompt": r.prompt_ids(str(x["text"] or "")), "params": r.params} for x in batch]


@dataclass
class _Written:
    """One request's reply so far: its token ids and how many characters were queued."""

    ids: list[int] = field(default_factory=list)
    queued: int = 0
    sentences: list[str] = field(default_factory=list)


class SentenceSplitter(NodeSubmodule):
    """Stream consumer of the decode node's ``token`` chunks: detokenizes the reply so far,
    queues each complete sentence for the ``tts`` loop (see
    :func:`mstar_rt.audio.agent.speech_queue`) and EMITs ``reply`` (the text queued so far) when
    one is; the last chunk queues the rest and closes the queue."""

    max_batch = 8
    _KEY = "_lm_reply_text"

    def __init__(self, responder: LMResponder, input_name: str = "token") -> None:
        self.responder, self.input_name = responder, input_name

    def prepare_inputs(self, ctx: WorkContext, inputs: dict[str, Any]) -> Any:
        from mstar_rt.audio.speak import speech_queue

        chunk = inputs[self.input_name]
        if not isinstance(chunk, StreamChunk):
            raise TypeError(f"SentenceSplitter reads '{self.input_name}' as a StreamChunk "
                            "(feed it through a StreamingGraphEdge), got "
                            f"{type(chunk).__name__}")
        state = ctx.request.state
        written = state.setdefault(self._KEY, _Written())
        return written, [int(t) for t in chunk.new_items], chunk.last, speech_queue(state)

    def end_stream(self, ctx: WorkContext) -> Mapping[str, Any]:
        """The reply ended where the last chunk ended: queue the rest and close the queue."""
        from mstar_rt.audio.speak import speech_queue

        state = ctx.request.state
        written = state.setdefault(self._KEY, _Written())
        return self.forward([(written, [], True, speech_queue(state))])[0]

    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = []
        for written, new, last, queue in batch:
            written.ids.extend(new)
            text = self.responder.text_of(written.ids)
            rest = text[written.queued:]
            if last:
                ready, cut = rest, len(rest)
            else:
                # Only text before the last boundary is final: a partly decoded character or
                # the sentence's next word may still change what follows it.
                ends = [m for m in _BOUNDARY.finditer(rest)]
                ready, cut = (rest[:ends[-1].start()], ends[-1].end()) if ends else ("", 0)
            sentences = split_sentences(ready)
            written.queued += cut
            for s in sentences:
                queue.put(s)
            written.sentences.extend(sentences)
            if last:
                queue.close()
            out.append({"reply": " ".join(written.sentences)} if sentences or last else {})
        return out
