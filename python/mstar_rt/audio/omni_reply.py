"""Speech to speech with an omni model: the user's utterance is the prompt, the model's own speech
the reply, with no recognizer and no TTS in between.

:class:`OmniVoiceAgent` is a :class:`~mstar_rt.audio.agent.VoiceAgent` (same mic thread, VAD and
endpointer, turns, preemptive replies and barge-in) whose reply request goes to a Runtime serving
an omni model such as :class:`~mstar_rt.models.qwen3_omni.omni.Qwen3Omni`. Each endpointed
utterance (16 kHz) becomes one user message with an ``input_audio`` part, formatted by the
model's chat format (:class:`~mstar_rt.models.qwen3_omni.chat.OmniChat`): its log-mel features
go to the thinker's audio encoder inside the request. The model EMITs ``token`` (the thinker's
text) and ``audio`` (the talker's speech, as code2wav decodes it); each audio chunk goes to the
speaker ring as it arrives, resampled to the output's rate. Barge-in cancels the request in the
Conductor, which frees the KV pages of thinker and talker, and flushes the output.

A turn's stages (:meth:`~mstar_rt.audio.turns.Turn.stages`) mean here: ``asr`` 0 (no
recognizer: the audio encoder runs inside the request), ``respond`` the thinker's first token
(audio encoder + prefill), ``tts_first`` the first audio (talker, code predictor and code2wav's
first window). ``Turn.text`` stays empty; ``Turn.reply`` is the thinker's transcript.
Conversation history: the last ``history`` turns (the user's audio and what the user heard of
the reply's transcript, :mod:`~mstar_rt.audio.heard`) precede each new utterance in the prompt.
"""

from __future__ import annotations

import base64
import io
import threading
import time
import wave
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from mstar_rt.audio.agent import RATE, WINDOW, VoiceAgent, check_input
from mstar_rt.audio.heard import heard_tokens, played_samples
from mstar_rt.audio.reply_stream import ReplyStream
from mstar_rt.audio.turns import Turn
from mstar_rt.models.qwen3_omni.chat import OmniChat

__all__ = ["OmniRequest", "OmniVoiceAgent", "omni_chat", "open_omni_agent"]

NAN = float("nan")
Encoded = tuple[list[int], list[np.ndarray]]  # a message's prompt ids and audio features


def omni_chat(model: Any) -> OmniChat:
    """The chat format of ``model`` (:meth:`OmniChat.of`); a ValueError naming what is missing
    when it has none."""
    chat = OmniChat.of(model)
    if chat is not None:
        return chat
    raise ValueError(f"{type(model).__name__} does not follow the omni chat contract (request "
                     "inputs 'prompt' and 'audio_features'; a tokenizer; speakers, sample_rate, "
                     "audio_output_length); load it with its tokenizer.json or pass chat=")


def _wav16(audio: np.ndarray, rate: int) -> str:
    """Float samples as the base64 of a 16-bit mono WAV (an ``input_audio`` part's data)."""
    pcm = (np.clip(np.asarray(audio, np.float32), -1.0, 1.0) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return base64.b64encode(buf.getvalue()).decode()


class OmniRequest:
    """One omni request as the agent reads it. Iterating it yields the request's events under
    the reply walk's names (``token`` as ``reply``, ``audio`` as ``audio_out``) and records, as
    they arrive, what the request made: its tokens, when each audio chunk came, when it ended;
    once the turn is over, what of it the user heard. ``agent.replies[turn.index]`` is the
    request that answered a turn."""

    RENAME = {"token": "reply", "audio": "audio_out"}

    def __init__(self, handle: Any, user: Encoded, prompt: list[int], audio_inputs: int) -> None:
        self.handle = handle
        self.user = user  # the utterance's message, for the history
        self.prompt, self.audio_inputs = prompt, audio_inputs  # ids; clips in the prompt
        self.tokens: list[int] = []
        self.audio_times: list[float] = []  # arrival of each audio chunk
        self.samples = 0  # at the model's rate
        self.ended_at = self.cancelled_at = NAN  # ended: ran to its end (NaN if cancelled)
        # once it is over: samples (model's rate) that reached the speaker, how many of
        # ``tokens`` they were made from, and the transcript of those the history keeps
        self.played = self.heard_tokens = 0
        self.heard: Optional[str] = None

    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def audio_frames(self) -> int:
        """Mel frames of the utterance (100 a second)."""
        return sum(f.shape[1] for f in self.user[1])

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, value in self.handle:
            if name == "token":
                self.tokens.append(int(value))
            elif name == "audio" and len(value):
                self.audio_times.append(time.monotonic())
                self.samples += len(value)
            yield self.RENAME.get(name, name), value
        self.ended_at = time.monotonic()

    def cancel(self) -> bool:
        self.cancelled_at = time.monotonic()
        return self.handle.cancel()

    def chrome_trace(self) -> dict:
        return self.handle.chrome_trace()


class OmniVoiceAgent(VoiceAgent):
    """``OmniVoiceAgent(model, input, output, vad, endpointer, ...)`` (or ``VoiceAgent.omni``):
    a voice agent whose replies an omni model hears and speaks. ``start()``, ``stop()``, ``turns``
    and ``stats()`` as for :class:`VoiceAgent`; ``replies`` maps a turn's index to its
    :class:`OmniRequest`.

    ``model``: served on a Runtime of the agent's own (``agent.runtime``). ``chat``: its chat
    format (default :func:`omni_chat`). ``system_prompt`` opens every prompt; ``speaker`` is the
    voice (None: the model's default). ``history``: how many earlier turns the prompt repeats
    (0: none), each the user's audio and the part of the reply that played (a barge-in cuts it
    to the tokens its played audio was made from; nothing played: no assistant message).
    ``max_tokens``, ``max_audio_frames`` and the ``*_sampling`` settings go into every request;
    ``agent.inputs`` holds them and may be changed between turns. ``prebuffer_s``: the
    audio a reply holds before it starts to play, so that it does not run dry before the
    model's next chunk (Qwen3-Omni's code2wav windows hold 2, 4, 8, then 12 frames of 80 ms,
    the first ~137 ms after the decoder's trim: the default 0.2 s plays once the second is in);
    a reply started at a pause has it ready by the endpoint, at no cost. ``input`` delivers
    16 kHz; ``output`` takes any ``source_rate`` (the model's rate needs no resampling here).
    """

    def __init__(self, model: Any, input: Any, output: Any, vad: Any, endpointer: Any,
                 chat: Optional[OmniChat] = None, system_prompt: Optional[str] = None,
                 speaker: Optional[str] = None, history: int = 4, max_tokens: int = 256,
                 max_audio_frames: Optional[int] = None, thinker_sampling: Any = None,
                 talker_sampling: Any = None, code_predictor_sampling: Any = None,
                 prebuffer_s: float = 0.2, barge_in: bool = True, reply_timeout: float = 30.0,
                 preemptive: bool = True) -> None:
        from mstar_rt.runtime import Runtime

        check_input(input)
        if not getattr(model, "speaks", True):
            raise ValueError(f"{type(model).__name__} has no talker: it cannot speak a reply "
                             "(load a checkpoint with the talker and code2wav)")
        self.model, self.chat = model, chat or omni_chat(model)
        self.sample_rate = self.chat.sample_rate
        self.prebuffer = int(prebuffer_s * self.sample_rate)
        self.inputs: dict[str, Any] = {
            "speaker": self.chat.speaker(speaker), "return_audio": True, "max_tokens": max_tokens,
            "max_audio_frames": max_audio_frames, "thinker_sampling": thinker_sampling,
            "talker_sampling": talker_sampling, "code_predictor_sampling": code_predictor_sampling}
        t = self.chat.tokens
        self._header = [t.im_start, t.assistant, *t.newline_ids]
        self._system = (self._encode({"role": "system", "content": system_prompt})
                        if system_prompt else ([], []))
        self.history_turns = history
        self.history: list[tuple[Encoded, Encoded]] = []  # (user, assistant), oldest first
        self._history_lock = threading.Lock()
        # held across a barge-in, so that the reply thread reads its flush's count whole
        self._cutting = threading.Lock()
        self.replies: dict[int, OmniRequest] = {}
        self.listen(input, output, vad, endpointer, Runtime(model, poll_s=0.01), barge_in,
                    reply_timeout, preemptive)

    # ---- the prompt ------------------------------------------------------------------------

    def _encode(self, message: Mapping[str, Any]) -> Encoded:
        """One message's prompt ids (without the assistant header format_chat ends with) and
        audio features; computed once per message, then reused by later prompts."""
        ids, features = self.chat.prompt([message])
        assert ids[-len(self._header):] == self._header, "format_chat ends with the header"
        return ids[:-len(self._header)], features

    def _prompt(self, user: Encoded) -> Encoded:
        ids, features = list(self._system[0]), list(self._system[1])
        with self._history_lock:
            said = [m for pair in self.history for m in pair]
        for m_ids, m_features in [*said, user]:
            ids += m_ids
            features += m_features
        return ids + self._header, features

    def _remember(self, user: Encoded, transcript: str) -> None:
        """A reply of which nothing was heard leaves no assistant message: the next prompt
        holds two user turns in a row, as the user lived it."""
        if self.history_turns <= 0:
            return
        try:
            reply = (self._encode({"role": "assistant", "content": transcript}) if transcript
                     else ([], []))
        except ValueError:  # a transcript the chat format refuses: the turn is not kept
            return
        with self._history_lock:
            self.history = (self.history + [(user, reply)])[-self.history_turns:]

    def _request(self, audio: np.ndarray, **overrides: Any) -> OmniRequest:
        user = self._encode({"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": _wav16(audio, RATE),
                                                     "format": "wav"}}]})
        prompt, features = self._prompt(user)
        inputs = {k: v for k, v in {**self.inputs, **overrides}.items() if v is not None}
        assert self.runtime is not None
        handle = self.runtime.submit({**inputs, "prompt": prompt, "audio_features": features},
                                     keep_outputs=False)
        return OmniRequest(handle, user, prompt, len(features))

    def _submit(self, audio: np.ndarray, pause: Optional[int] = None,  # type: ignore[override]
                guess: Optional[str] = None) -> Optional[ReplyStream]:
        try:
            return ReplyStream(self._request(audio), pause)
        except Exception:
            if pause is None:
                raise
            # At a pause, on the mic thread: the reply is not started early; the endpoint
            # submits it again, and the turn records the error.
            return None

    # ---- the reply -------------------------------------------------------------------------

    def warm_up(self, timeout: float = 30.0) -> None:
        """A short reply to half a second of silence, played nowhere (first runs of every node
        and the mel front end are slower than later ones)."""
        request = self._request(np.zeros(RATE // 2, np.float32), max_tokens=2,
                                max_audio_frames=4)
        timer = threading.Timer(timeout, request.cancel)
        timer.daemon = True
        timer.start()
        try:
            for _ in request:
                pass
        finally:
            timer.cancel()

    def _chunks(self, turn: Turn, audio: np.ndarray,
                stream: Optional[ReplyStream]) -> Iterator[np.ndarray]:
        """The reply's audio at the output's rate, chunk by chunk as the model makes it."""
        from mstar_rt.audio.resample import Resampler
        from mstar_rt.runtime import RequestCancelled

        if stream is None:
            stream = ReplyStream(self._request(audio))
        request: OmniRequest = stream.handle
        self.replies[turn.index] = request
        turn.submitted = turn.recognized_at = stream.submitted  # no recognition stage
        self.track_reply(request)
        timer = threading.Timer(self.reply_timeout, request.cancel)
        timer.daemon = True
        timer.start()
        rate = getattr(self.output, "source_rate", self.sample_rate)
        resampler = Resampler(self.sample_rate, rate) if rate != self.sample_rate else None
        held: Optional[list[np.ndarray]] = []  # the prebuffer, until it is full
        try:
            for name, value in stream:
                if name == "reply":
                    turn.replied_at = stream.replied_at
                elif name == "audio_out" and len(value):
                    turn.first_audio = stream.first_audio
                    if held is not None:
                        held.append(value)
                        if sum(map(len, held)) < self.prebuffer:
                            continue
                        value, held = np.concatenate(held), None
                    yield value if resampler is None else resampler.process(value)
            tail = np.concatenate(held) if held else np.zeros(0, np.float32)
            if resampler is not None or len(tail):
                yield tail if resampler is None else resampler.process(tail, last=True)
            stream.join(1.0)
            turn.trace = request.chrome_trace()
        except RequestCancelled:
            if not self.interrupted:
                raise TimeoutError(f"reply took over {self.reply_timeout} s") from None
        finally:
            timer.cancel()
            turn.reply = self._text(request.tokens)

    def _text(self, tokens: list[int]) -> str:
        t = self.chat.tokens
        return self.chat.decode([i for i in tokens if i not in t.reserved and i != t.im_end])

    def _interrupt(self, now: Optional[float] = None) -> None:
        with self._cutting:
            super()._interrupt(now)

    def _reply(self, turn: Turn, audio: np.ndarray, stream: Optional[ReplyStream]) -> None:
        """Plays the reply, then keeps in the history what of it reached the speaker (a barge-in
        may come while it is made or while it plays)."""
        try:
            super()._reply(turn, audio, stream)
        finally:
            request = self.replies.get(turn.index)
            if request is not None:
                self._remember(request.user, self._heard(turn, request))

    def _heard(self, turn: Turn, request: OmniRequest) -> str:
        cut = self.interrupted
        if cut:  # the barge-in's flush is counted once it lets go
            with self._cutting:
                pass
        whole = not cut and request.ended_at == request.ended_at  # ran to its end (not NaN)
        request.played = played_samples(turn.written_frames, turn.flushed_frames, self.output,
                                        self.sample_rate)
        tokens = heard_tokens(request.tokens, request.played, whole,
                              getattr(self.model, "tokens_read_by", None))
        request.heard_tokens, request.heard = len(tokens), self._text(tokens)
        return request.heard


def open_omni_agent(model: Any, mic_source: Optional[str] = None,
                    speaker_sink: Optional[str] = None, rate: int = 48000, blocksize: int = 480,
                    output_latency: float = 0.1, **options: Any) -> OmniVoiceAgent:
    """An :class:`OmniVoiceAgent` on its own streams: PulseAudio ``mic_source``/``speaker_sink``
    (the virtual devices) or, when both are None, the default devices; Silero VAD and the
    endpointer; the output resamples the model's rate (24 kHz for Qwen3-Omni) to ``rate``.
    ``options`` go to :class:`OmniVoiceAgent`; ``stop()`` closes the streams. Imports
    sounddevice: start virtual devices first."""
    from mstar_rt.audio import devices
    from mstar_rt.audio.vad import Endpointer, SileroVAD

    chat = options.pop("chat", None) or omni_chat(model)
    inp = devices.AudioInput(rate, blocksize=blocksize, pulse_source=mic_source,
                             target_rate=RATE, ring_seconds=8.0)
    out = devices.AudioOutput(rate, blocksize=blocksize, pulse_sink=speaker_sink,
                              source_rate=chat.sample_rate, latency=output_latency,
                              ring_seconds=60.0)
    try:
        agent = OmniVoiceAgent(model, inp, out, SileroVAD(RATE),
                               Endpointer(sample_rate=RATE, window=WINDOW), chat=chat, **options)
    except BaseException:
        inp.close()
        out.close()
        raise
    agent.owned = [inp, out]
    return agent
