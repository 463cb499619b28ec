"""A deployment: one served model behind one runtime, with what the front-end needs to know about
it (its name, how speech, chat and policy requests map onto its inputs and EMITs, the
limits)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from mstar_rt.config.errors import ConfigError
from mstar_rt.serve.config import PolicySpec, ServeConfig, SpeechSpec


@dataclass
class Deployment:
    """``runtime`` is anything with ``submit(inputs, deadline=, priority=) -> handle``,
    ``close()`` and ``live`` (the in-process :class:`~mstar_rt.Runtime`, or a multi-process
    one); ``inputs`` are the model's input names, ``optional_inputs`` those with a default;
    ``chat`` is set for a speech-in, speech-out chat model (an
    :class:`~mstar_rt.models.qwen3_omni.chat.OmniChat`), which serves /v1/chat/completions."""

    runtime: Any
    name: str
    inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    speech: Optional[SpeechSpec] = None
    policy: PolicySpec = field(default_factory=PolicySpec)
    max_concurrent_requests: int = 64
    request_timeout_s: Optional[float] = None
    api_key: Optional[str] = None
    chat: Optional[Any] = None
    created: int = field(default_factory=lambda: int(time.time()))

    @staticmethod
    def for_model(model: Any, runtime: Any, name: Optional[str] = None,
                  speech: Optional[SpeechSpec] = None, policy: Optional[PolicySpec] = None,
                  **kw: Any) -> "Deployment":
        """Fills what the config leaves out from the model: a model with a ``sample_rate``
        serves speech (its ``voices``, if it has them, are the voices accepted); an omni chat
        model (Qwen3-Omni: inputs ``prompt`` and ``audio_features``, see
        :meth:`OmniChat.of`) serves chat, and speech from a chat prompt with its ``speakers``
        as voices; a model with ``openpi_defaults()`` (a LeRobot policy) gives the policy
        mapping."""
        omni = {"prompt", "audio_features"} <= set(getattr(model, "inputs", ()) or ())
        chat = _omni_chat(model) if omni else None  # None without a tokenizer
        if speech is None and chat is not None:
            speech = SpeechSpec(text_input="prompt", voice_input="speaker", audio_output="audio",
                                voices=list(chat.speakers))
        if speech is None and hasattr(model, "sample_rate") and not omni:
            speech = SpeechSpec()
        if speech is not None:
            missing = [k for k in (speech.text_input, speech.voice_input)
                       if k is not None and k not in model.inputs]
            if missing:
                raise ValueError(f"speech: the model {type(model).__name__} has no inputs "
                                 f"{missing}; its inputs are {list(model.inputs)} (set "
                                 "speech.text_input / speech.voice_input)")
            rate = speech.model_rate or getattr(model, "sample_rate", None)
            if rate is None:
                raise ValueError("speech.model_rate: the model has no sample_rate; give the rate "
                                 "of its audio")
            voices = speech.voices if speech.voices is not None else tuple(
                getattr(model, "voices", ()) or ())
            speech = speech.model_copy(update=dict(model_rate=int(rate), voices=voices))
            check_speech(model, speech)
        if policy is not None:
            check_policy(model, policy)
        if policy is None and hasattr(model, "openpi_defaults"):  # e.g. a LeRobot checkpoint
            policy = PolicySpec(**model.openpi_defaults())
        return Deployment(runtime=runtime, name=name or type(model).__name__,
                          inputs=tuple(model.inputs), speech=speech,
                          optional_inputs=tuple(getattr(model, "input_defaults", None) or ()),
                          policy=policy or PolicySpec(), chat=chat, **kw)

    @staticmethod
    def from_config(config: ServeConfig, model: Any, runtime: Any) -> "Deployment":
        return Deployment.for_model(
            model, runtime, config.model.name, config.speech, config.policy,
            max_concurrent_requests=config.max_concurrent_requests,
            request_timeout_s=config.request_timeout_s, api_key=config.server.api_key)

    @property
    def capabilities(self) -> list[str]:
        return (["generate", "policy"] + (["speech"] if self.speech is not None else [])
                + (["chat"] if self.chat is not None else []))


def emit_names(model: Any) -> tuple[str, ...]:
    """The names a model EMITs (empty when it declares no nodes to read them from)."""
    from mstar_rt.graph import EMIT, GraphEdge

    return tuple(dict.fromkeys(out.name for node in getattr(model, "nodes", None) or ()
                               for out in node.outputs
                               if isinstance(out, GraphEdge) and out.to == EMIT))


# A name that matches nothing in the model was ignored: every request then failed, or a speech
# request got 200 and an empty WAV; so the config is refused when the server starts.

def check_speech(model: Any, speech: SpeechSpec) -> None:
    emits = emit_names(model)
    if emits and speech.audio_output not in emits:
        raise ConfigError(f"speech.audio_output: the model EMITs no {speech.audio_output!r}; it "
                          f"EMITs {list(emits)}")
    known = tuple(getattr(model, "voices", ()) or ())
    unknown = [v for v in speech.voices or () if known and v not in known]
    if unknown:
        raise ConfigError(f"speech.voices: the model has no voices {unknown}; it has "
                          f"{list(known)}")
    inputs = tuple(getattr(model, "inputs", ()) or ())
    stray = [k for k in speech.inputs if inputs and k not in inputs]
    if stray:  # every speech request would be refused, as if the client had sent them
        raise ConfigError(f"speech.inputs: {stray} are not inputs of the model; its inputs are "
                          f"{list(inputs)}")


def check_policy(model: Any, policy: PolicySpec) -> None:
    emits, inputs = emit_names(model), tuple(getattr(model, "inputs", ()) or ())
    for key, name in [("policy.actions", policy.actions)] + [
            (f"policy.outputs.{k}", k) for k in policy.outputs]:
        if emits and name not in emits:
            raise ConfigError(f"{key}: the model EMITs no {name!r}; it EMITs {list(emits)}")
    targets = list(policy.observation.values()) or list(inputs)
    keys = list(policy.observation) or list(inputs)
    stray = [k for k in policy.images if k not in keys]
    if stray:  # a misspelt key is ignored: the image it meant would reach the model undecoded
        raise ConfigError(f"policy.images names {stray}, which are not observation keys; "
                          f"those are {keys}")
    for section in ("shapes", "dtypes"):
        for name in getattr(policy, section):
            if name not in targets:
                raise ConfigError(f"policy.{section}.{name}: not an input the observation maps "
                                  f"to; those are {targets}")


def _omni_chat(model: Any) -> Optional[Any]:
    """The chat view of a model taking ``prompt`` and ``audio_features``, if it has one."""
    from mstar_rt.models.qwen3_omni.chat import OmniChat

    return OmniChat.of(model)
