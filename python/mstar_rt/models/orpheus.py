"""Orpheus-style text to speech: a Llama LM that speaks SNAC codes, streamed into the SNAC decoder.

Two walks per request:

* ``prefill`` caches the prompt ``[start_of_human, bos, text..., eot, end_of_human, start_of_ai,
  start_of_speech]`` but its last token, without sampling (``LMNode(prefill_samples=False)``),
  and persists ``start_of_speech`` into the next walk -- so every audio token is made by the
  ``decode`` node and enters the audio stream at its true position (the SNAC frame alignment
  counts from the first token after ``start_of_speech``);
* ``speak`` = ``Parallel(DynamicLoop("decode"), "snac_decoder")``: each decoded token goes
  through a :class:`~mstar_rt.StreamingGraphEdge` (default policy Orpheus' own
  ``SlidingWindow(28, 7)``) to the SNAC node, which EMITs ``audio`` (float32, 24 kHz) while the
  LM is still talking: the first frame after 28 tokens, then a frame per 7. The node carries the
  context the 4-frame windows lack, so the audio is sample-exact under this or any policy. The
  loop stops on ``end_of_speech`` or ``max_tokens``.

    tts = OrpheusTTS.from_pretrained("orpheus-3b-0.1-ft", "snac_24khz")
    with mstar_rt.Runtime(tts) as rt:
        for name, value in rt.submit({"text": "Hello there.", "voice": "tara"}):
            if name == "audio":
                play(value)

``constrain_codes=True`` masks the logits so that the token at stream position p is a code of
slot p mod 7 (or ``end_of_speech``, at frame boundaries only): a random model then speaks valid
frames, and a real one cannot emit a frame the decoder would drop.
:meth:`OrpheusTTS.tiny` builds a small random LM and a reduced-width SNAC (the real 24 kHz
receptive field) for tests and CPU demos. The voice agent speaks through it with
:class:`mstar_rt.audio.tts.OrpheusSpeech`, its TTS backend.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from mstar_rt.engines.kv_engine import KVCacheEngine, KVWork
from mstar_rt.engines.sampling import SamplingParams
from mstar_rt.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, Parallel, StreamingGraphEdge
from mstar_rt.model import Model, RequestContext, WorkContext
from mstar_rt.models.causal_lm import LOOP, LMNode, as_params, prompt_tensor
from mstar_rt.models.checkpoint import read_tokenizer
from mstar_rt.models.llama import LlamaConfig, LlamaForCausalLM
from mstar_rt.models.snac import SnacConfig, SnacDecoder
from mstar_rt.models.snac_stream import AudioTokenLayout, SnacStreamNode
from mstar_rt.streaming import SlidingWindow

#: What Orpheus streams with: windows of 4 frames, a new one each. The first frame can be decoded
#: exactly once 4 frames are in (it needs the 3 after it), and the node carries the 3 before
#: later frames that the window lacks.
ORPHEUS_POLICY = SlidingWindow(28, 7)

#: The voices Orpheus 3B 0.1 ft was fine-tuned on (its README); pass as ``voices=`` to refuse
#: others, which that model would otherwise read out in some voice of its own.
ORPHEUS_FT_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")


@dataclass(frozen=True)
class OrpheusTokens:
    """The special token ids of the Orpheus prompt and audio layout (defaults: Orpheus 3B on
    the Llama-3 vocabulary). Audio code c of slot s is ``audio_base + s * codebook_size + c``.
    ``text_base``: where UTF-8 bytes land when there is no tokenizer (byte b -> text_base + b)."""

    start_of_human: int = 128259
    bos: int = 128000
    eot: int = 128009
    end_of_human: int = 128260
    start_of_ai: int = 128261
    start_of_speech: int = 128257
    end_of_speech: int = 128258
    audio_base: int = 128266
    codebook_size: int = 4096
    text_base: int = 0

    @staticmethod
    def tiny(codebook_size: int = 64) -> "OrpheusTokens":
        """The real layout in miniature: bytes 0..255 as text, specials from 256, audio codes
        from 266 (vocabulary :attr:`min_vocab` = 266 + 7 * codebook_size)."""
        return OrpheusTokens(start_of_human=259, bos=256, eot=262, end_of_human=260,
                             start_of_ai=261, start_of_speech=257, end_of_speech=258,
                             audio_base=266, codebook_size=codebook_size, text_base=0)

    @property
    def layout(self) -> AudioTokenLayout:
        return AudioTokenLayout(self.audio_base, self.codebook_size, self.end_of_speech)

    @property
    def min_vocab(self) -> int:
        """The smallest vocabulary holding every id here (audio codes are the top)."""
        return max(self.audio_base + 7 * self.codebook_size, self.start_of_human,
                   self.bos, self.eot, self.end_of_human, self.start_of_ai,
                   self.start_of_speech, self.end_of_speech, self.text_base + 256) + 1

    def prompt(self, text_ids: Sequence[int]) -> list[int]:
        """The LM prompt for text token ids (without bos: it is added here)."""
        return [self.start_of_human, self.bos, *map(int, text_ids), self.eot, self.end_of_human,
                self.start_of_ai, self.start_of_speech]


class TextEncoder:
    """Text -> token ids: a ``tokenizer.json`` (loaded on first use with the `tokenizers`
    package, special tokens not added) or, with ``path=None``, UTF-8 bytes at ``byte_base``."""

    def __init__(self, path: Optional[Union[str, os.PathLike]] = None, byte_base: int = 0) -> None:
        self.path, self.byte_base = path, byte_base
        self._tokenizer: Any = None
        if path is not None and importlib.util.find_spec("tokenizers") is not None:
            self._tokenizer = read_tokenizer(path)  # a broken file is the load's error

    def __call__(self, text: str) -> list[int]:
        if self.path is None:
            return [self.byte_base + b for b in text.encode("utf-8")]
        if self._tokenizer is None:
            try:
                self._tokenizer = read_tokenizer(self.path)
            except ImportError as e:
                raise ImportError("reading text needs the `tokenizers` package (pip install "
                                  "tokenizers), or pass token ids as 'prompt'") from e
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def no_text(text: str) -> list[int]:
    raise ValueError("this OrpheusTTS has no tokenizer (no tokenizer.json next to the "
                     "checkpoint); submit token ids as 'prompt' instead of 'text'")


class SpeechLM(LMNode):
    """The LM node of :class:`OrpheusTTS`: builds the prompt from ``text`` / ``prompt`` and
    ``voice``, fills in the model's default sampling parameters, and optionally constrains
    each token to its slot's codes."""

    def __init__(self, tts: "OrpheusTTS", module: torch.nn.Module, max_seq_len: int,
                 max_batch: int, emit_logits: bool, cuda_graphs: bool,
                 compile: Union[bool, str]) -> None:
        self.tts = tts
        super().__init__(module, (tts.tokens.end_of_speech,), max_seq_len, max_batch,
                         emit_logits, cuda_graphs, compile, prefill_samples=False,
                         logits_processor=self.constrain if tts.constrain_codes else None)

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        if "text" in inputs:  # prefill
            inputs = {"prompt": self.tts.prompt_ids(inputs), "params": inputs["params"]}
        return super().prepare_inputs(ctx, inputs)

    def request_params(self, params: Any) -> SamplingParams:
        return self.tts.default_params if params is None else as_params(params)

    def constrain(self, state: dict, logits: torch.Tensor) -> torch.Tensor:
        """Keeps the codes of this position's slot, and ``end_of_speech`` where a frame would
        begin (so the speech never ends mid-frame) unless the request ignores EOS."""
        t = self.tts.tokens
        p = state["generated"]  # every generated token is an audio stream token
        lo = t.audio_base + (p % 7) * t.codebook_size
        out = torch.full_like(logits, float("-inf"))
        out[lo: lo + t.codebook_size] = logits[lo: lo + t.codebook_size]
        if p % 7 == 0 and not state["params"].ignore_eos:
            out[t.end_of_speech] = logits[t.end_of_speech]
        return out


class OrpheusTTS(Model):
    """Serves an Orpheus-style speech LM (``lm``: a :class:`LlamaForCausalLM`) with a SNAC
    decoder. Inputs: ``text`` (str) or ``prompt`` (the text's token ids), ``voice`` (prefixes
    ``"voice: "`` to the text), ``params`` (:class:`SamplingParams` or dict; default
    ``default_params``: Orpheus' settings). EMITs ``audio`` chunks (float32 numpy,
    ``sample_rate`` Hz) and, with ``emit_tokens``, every generated ``token``.

    ``policy``: the chunk policy of the token stream into the decoder (default
    :data:`ORPHEUS_POLICY`, ``SlidingWindow(28, 7)``). ``carry_context``: the SNAC node keeps the
    context short windows lack, so every policy is exact; with False it decodes from windows alone
    and the policy must hold the context (checked with :meth:`SnacStreamNode.check_policy`; e.g.
    :meth:`SnacStreamNode.exact_policy`). ``engine``: the LM's KVCacheEngine; ``codec_batch``:
    windows decoded per SNAC call at most. ``voices``: the voice names the LM knows (e.g.
    :data:`ORPHEUS_FT_VOICES`); another is refused at submit. Empty (the default): any voice.
    """

    inputs = ("text", "prompt", "voice", "params")
    input_defaults = {"text": None, "prompt": None, "voice": None, "params": None}

    def __init__(self, lm: torch.nn.Module, decoder: SnacDecoder,
                 tokens: OrpheusTokens = OrpheusTokens(),
                 text_encoder: Optional[Callable[[str], list[int]]] = None,
                 policy: Any = None, carry_context: bool = True, constrain_codes: bool = False,
                 default_params: Optional[SamplingParams] = None,
                 max_seq_len: Optional[int] = None, engine: Optional[KVCacheEngine] = None,
                 max_batch: int = 64, codec_batch: int = 8, emit_tokens: bool = True,
                 emit_logits: bool = False, cuda_graphs: bool = False,
                 compile: Union[bool, str] = False, voices: Sequence[str] = ()) -> None:
        vocab = int(lm.config.vocab_size)
        if vocab < tokens.min_vocab:
            raise ValueError(f"the LM's vocabulary has {vocab} tokens but the Orpheus token "
                             f"layout needs {tokens.min_vocab} (audio codes up to "
                             f"{tokens.audio_base + 7 * tokens.codebook_size - 1}); check tokens=")
        self.voices = () if isinstance(voices, str) else tuple(voices)  # what serving offers
        if isinstance(voices, str) or not all(isinstance(v, str) and v for v in self.voices):
            raise TypeError(f"voices must be a sequence of voice names, not {voices!r}")
        self.tokens = tokens
        self.layout = tokens.layout
        self.decoder = decoder.eval()
        self.text_encoder = text_encoder or TextEncoder(None, tokens.text_base)
        self.constrain_codes = constrain_codes
        self.default_params = default_params or SamplingParams(
            max_tokens=1200, temperature=0.6, top_p=0.8, repetition_penalty=1.3)
        self.sample_rate = decoder.config.sampling_rate
        self.policy = policy if policy is not None else ORPHEUS_POLICY
        SnacStreamNode.check_policy(decoder, self.policy, self.layout, carry_context)
        max_seq_len = max_seq_len or int(lm.config.max_position_embeddings)
        self.module = lm.eval()
        self.lm = SpeechLM(self, lm, max_seq_len, max_batch, emit_logits, cuda_graphs, compile)
        self.codec = SnacStreamNode(decoder, self.layout, max_batch=codec_batch,
                                    carry_context=carry_context)
        emits = ([GraphEdge(EMIT, "token")] if emit_tokens else []) + (
            [GraphEdge(EMIT, "logits")] if emit_logits else [])
        self.nodes = [
            GraphNode("prefill", ["text", "prompt", "voice", "params"],
                      [GraphEdge("decode", "token", persist=True)], submodule=self.lm, engine="lm"),
            GraphNode("decode", ["token"],
                      emits + ["token", StreamingGraphEdge("snac_decoder", "token", self.policy)],
                      submodule=self.lm, engine="lm"),
            GraphNode("snac_decoder", ["token"], [GraphEdge(EMIT, "audio")],
                      submodule=self.codec, engine="codec"),
        ]
        self.walks = {"prefill": "prefill",
                      "speak": Parallel(DynamicLoop("decode", max_seq_len, LOOP), "snac_decoder")}
        self.engine_specs = {"lm": engine or KVCacheEngine(max_batch=max_batch)}

    # ---- prompts -------------------------------------------------------------------------------

    def prompt_ids(self, inputs: Mapping[str, Any]) -> list[int]:
        """The LM prompt of a request's inputs (``text`` or ``prompt``, and ``voice``)."""
        text, ids, voice = inputs.get("text"), inputs.get("prompt"), inputs.get("voice")
        if (text is None) == (ids is None):
            raise ValueError("give either 'text' (a string) or 'prompt' (text token ids), "
                             "not both or neither")
        if voice is not None and not isinstance(voice, str):  # 123 became the text "123: "
            raise TypeError(f"'voice' must be a string (a voice name) or None, not "
                            f"{type(voice).__name__}")
        if voice and self.voices and voice not in self.voices:
            raise ValueError(f"unknown voice {voice!r}: this model speaks {list(self.voices)} "
                             "(or give no voice)")
        if text is not None:
            if not isinstance(text, str):
                raise TypeError(f"'text' must be a string, not {type(text).__name__}")
            if not text.strip():  # the LM babbled on from the bare prompt
                raise ValueError("'text' is empty or only whitespace: give the words to speak")
            ids = self.text_encoder(f"{voice}: {text}" if voice else text)
        else:
            ids = prompt_tensor(ids).tolist()  # integers only: [1.5, 2.7] was cast to [1, 2]
            if not ids:
                raise ValueError("'prompt' is empty: give the token ids of the text to speak")
            if voice:
                ids = self.text_encoder(f"{voice}: ") + ids
        return self.tokens.prompt(torch.as_tensor(ids, dtype=torch.long).reshape(-1).tolist())

    def validate_inputs(self, inputs: Mapping[str, Any]) -> None:
        self.lm.check_prompt(self.prompt_ids(inputs))
        self.lm.check_params(inputs.get("params"))

    def next_walk(self, request: RequestContext, finished_walk: str,
                  persisted: Mapping[str, Any]) -> Optional[str]:
        if finished_walk == "prefill" and not request.state.get("done", True):
            return "speak"
        return None

    # ---- construction --------------------------------------------------------------------------

    @staticmethod
    def from_pretrained(lm_dir: Union[str, os.PathLike], snac_dir: Union[str, os.PathLike],
                        dtype: Optional[torch.dtype] = None, device: str = "cpu",
                        snac_device: Optional[str] = None, progress: bool = True,
                        tokens: OrpheusTokens = OrpheusTokens(), **kwargs: Any) -> "OrpheusTTS":
        """An Orpheus LM checkpoint (Llama ``config.json`` + safetensors, ``tokenizer.json``
        for text) and a SNAC 24 kHz checkpoint directory. The SNAC decoder runs in float32."""
        from mstar_rt.models.llama import load_llama
        from mstar_rt.models.snac import load_snac

        lm = load_llama(lm_dir, dtype=dtype, device=device, progress=progress)
        decoder = load_snac(snac_dir, device=snac_device or device, progress=progress)
        tok = os.path.join(lm_dir, "tokenizer.json")
        encoder = TextEncoder(tok) if os.path.exists(tok) else no_text
        return OrpheusTTS(lm, decoder, tokens, text_encoder=kwargs.pop("text_encoder", encoder),
                          **kwargs)

    @staticmethod
    def tiny(seed: int = 0, lm_config: Optional[Mapping[str, Any]] = None,
             snac_config: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> "OrpheusTTS":
        """A random LM and a reduced-width SNAC (see :func:`tiny_lm`, :func:`tiny_snac`) over
        :meth:`OrpheusTokens.tiny`; ``kwargs`` go to :class:`OrpheusTTS`."""
        tokens = kwargs.pop("tokens", None) or OrpheusTokens.tiny()
        decoder = tiny_snac(seed, codebook_size=tokens.codebook_size, **(snac_config or {}))
        return OrpheusTTS(tiny_lm(tokens, seed, **(lm_config or {})), decoder, tokens, **kwargs)


def tiny_lm(tokens: OrpheusTokens, seed: int = 0, **config: Any) -> LlamaForCausalLM:
    """A random Llama whose vocabulary covers ``tokens`` (2 layers, hidden 64 by default)."""
    fields = dict(vocab_size=tokens.min_vocab, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=4096)
    fields.update(config)
    torch.manual_seed(seed)
    module = LlamaForCausalLM(LlamaConfig(**fields))
    for p in module.parameters():  # a scale at which the logits spread and tokens vary
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.1)
    return module.eval()


def tiny_snac(seed: int = 0, **config: Any) -> SnacDecoder:
    """A random SNAC decoder of the 24 kHz model's shape -- rates, strides, hence its (3, 3)
    frame receptive field and 2048 samples a frame -- but narrow (``decoder_dim`` 64, latent
    64, 64 codes), weight norm folded."""
    fields = dict(decoder_dim=64, latent_dim=64, codebook_size=64)
    fields.update(config)
    cfg = SnacConfig(**fields)
    torch.manual_seed(seed)
    decoder = SnacDecoder(cfg)
    with torch.no_grad():  # trained Snake alphas are not all 1: vary them
        for name, p in decoder.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.5, 2.0)
    return decoder.fold_weight_norm().eval()


__all__ = ["ORPHEUS_FT_VOICES", "ORPHEUS_POLICY", "OrpheusTTS", "OrpheusTokens", "SpeechLM",
           "TextEncoder", "tiny_lm", "tiny_snac"]
