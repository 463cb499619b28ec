"""A live speech-to-speech agent: microphone → VAD/endpointer → recognition → response → TTS →
speaker, with barge-in.

Listening is a walk graph too: :class:`ListenModel` is one long request whose ``mic`` node (a
DynamicLoop on its own engine) reads one 32 ms block per iteration and streams it, one block per
``Fixed(1)`` window, into the ``vad`` node (Silero + endpointer), which EMITs the endpointer's
events. The agent's mic thread only turns those events into turns; it never waits on the reply, so
it hears the user while the agent talks. The reply thread submits each utterance to a Runtime
serving :class:`ReplyModel` (walk ``asr → respond → DynamicLoop(tts)``, EMITting the text, the
reply and the audio chunks as the TTS makes them; with an LM responder the LM's decode loop streams
into a sentence splitter that feeds the speech loop) and streams the chunks into the speaker ring
as they come. Barge-in (speech starting while a reply is queued or playing) cancels the request in
the Conductor and flushes the output ring, and writes tagged with the old epoch are dropped.

Preemptive replies: the reply starts at the first quiet window of an utterance (the endpointer's
"pause"), while the endpointer still waits for its silence; its outputs are kept, not played.
Speech resuming cancels it (KV pages freed, the work counted as wasted); the endpoint confirmed at
that pause adopts it, so its audio is ready or nearly so. Adaptive endpointing: when the preemptive
recognition already reads as a whole command (``complete``: the grammar's, or a finished sentence),
the endpointer ends the utterance after its shorter silence. Every turn records when each stage
finished (:class:`~mstar_rt.audio.turns.Turn`; ``agent.stats()`` gives p50 / p90 per stage) and the
reply walk's Chrome trace.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from mstar_rt.audio.commands import CommandResponder
from mstar_rt.audio.grammar import CommandGrammar, ends_sentence
from mstar_rt.audio.listen import RATE, WINDOW, ListenModel, MicReader
from mstar_rt.audio.reply_model import ReplyModel
from mstar_rt.audio.reply_stream import ReplyStream
from mstar_rt.audio.tts import TTS
from mstar_rt.audio.turns import Turn, VoiceStats, dac_time

__all__ = ["RATE", "WINDOW", "CommandResponder", "ListenModel", "ReplyModel", "Turn", "VoiceAgent",
           "VoiceStats", "dac_time", "ends_sentence", "open_agent"]


# ---- the agent -----------------------------------------------------------------------------

def check_input(input: Any) -> None:
    if getattr(input, "target_rate", RATE) != RATE:
        raise ValueError(f"the input must deliver {RATE} Hz (AudioInput(target_rate={RATE}))")


class VoiceAgent:
    """``VoiceAgent(input, output, vad, endpointer, asr, responder, tts)``; ``start()``,
    ``stop()``, or use it as a context manager. ``turns`` lists :class:`Turn` records.

    ``input`` is an AudioInput whose ``target_rate`` is 16 kHz; ``output`` an AudioOutput whose
    ``source_rate`` is ``tts.sample_rate``. ``use_runtime=False`` runs the same steps as plain
    calls on the reply thread (no Conductor), for comparison. ``preemptive`` starts replies at
    pauses (needs the Runtime; the endpointer is switched to report pauses); ``complete(text)``
    says whether a recognition is a whole utterance (adaptive endpointing; None: never), asked
    of the streaming ``partial`` recognizer's hypotheses when there is one (a grammar's batch
    decode lands on a whole sentence unless its search failed, so only a live decode can tell),
    else of the preemptive recognition; a batch result that is not whole does not overrule a
    whole guess.
    """

    def __init__(self, input: Any, output: Any, vad: Any, endpointer: Any, asr: Any,
                 responder: Callable[[str], str], tts: TTS, barge_in: bool = True,
                 use_runtime: bool = True, reply_timeout: float = 30.0, preemptive: bool = True,
                 complete: Optional[Callable[[str], bool]] = None, partial: Any = None) -> None:
        check_input(input)
        if getattr(output, "source_rate", tts.sample_rate) != tts.sample_rate:
            raise ValueError(f"the output must take the TTS rate {tts.sample_rate} Hz "
                             f"(AudioOutput(source_rate={tts.sample_rate}))")
        self.asr, self.responder, self.tts = asr, responder, tts
        runtime = None
        if use_runtime:
            from mstar_rt.runtime import Runtime
            runtime = Runtime(ReplyModel(asr, responder, tts), poll_s=0.01)
        self.listen(input, output, vad, endpointer, runtime, barge_in, reply_timeout,
                     preemptive and use_runtime, complete, partial)

    @staticmethod
    def omni(model: Any, input: Any, output: Any, vad: Any, endpointer: Any,
             **options: Any) -> "VoiceAgent":
        """A speech-to-speech agent: the utterance's audio goes into an omni model (e.g.
        Qwen3-Omni), whose speech streams to the output; see
        :class:`~mstar_rt.audio.omni_reply.OmniVoiceAgent` for the ``options``."""
        from mstar_rt.audio.omni_reply import OmniVoiceAgent
        return OmniVoiceAgent(model, input, output, vad, endpointer, **options)

    def listen(self, input: Any, output: Any, vad: Any, endpointer: Any, runtime: Any,
               barge_in: bool, reply_timeout: float, preemptive: bool,
               complete: Optional[Callable[[str], bool]] = None, partial: Any = None) -> None:
        """The state every kind of reply shares (streams, listening, turns, barge-in); a
        constructor calls it once."""
        self.input, self.output = input, output
        self.vad, self.endpointer, self.runtime = vad, endpointer, runtime
        self.barge_in, self.reply_timeout, self.preemptive = barge_in, reply_timeout, preemptive
        self.complete, self.partial = complete, partial
        if self.preemptive or partial is not None:
            endpointer.pauses = True
        self._preempt: Optional[ReplyStream] = None  # the reply started at the current pause
        self._wasted, self._cancelled = 0.0, 0  # preemptive work dropped in this utterance
        self._utt = -1  # the utterance the endpointer is in (counting its starts)
        self._pause: Optional[int] = None  # sample of the pause the utterance is in, if any
        self._partial: Any = None  # the streaming recognizer's latest Partial of it
        self.turns: list[Turn] = []
        self.owned: list[Any] = []  # streams stop() closes (set by open_agent)
        self.windows = 0  # VAD windows processed
        self.errors: list[str] = []
        self._utterances: "queue.Queue[Optional[tuple[Turn, np.ndarray, Optional[ReplyStream]]]]" \
            = queue.Queue()
        self._stop = threading.Event()
        self._current: Optional[Turn] = None  # the turn being replied to (reply thread)
        self._handle: Any = None  # its Runtime request
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # _current/_handle between the two threads
        self._speech_start = 0.0
        self._deaf = False  # the current utterance began while the agent talked (no barge-in)
        self._threads: list[threading.Thread] = []

    # ---- lifecycle -------------------------------------------------------------------------

    def warm_up(self, timeout: float = 30.0) -> None:
        """One reply to silence through the whole pipeline, played nowhere: the first ONNX and
        decoder runs are several times slower than later ones and would land on the first turn."""
        quiet = np.zeros(RATE // 2, np.float32)
        if self.runtime is not None:
            self.runtime.submit({"audio": quiet}).result(timeout=timeout)
        else:
            for _ in self.tts.synthesize_stream(self.responder(self.asr.recognize(quiet).text)):
                pass

    def start(self, warm_up: bool = True) -> "VoiceAgent":
        if warm_up:
            self.warm_up()
        self._threads = [threading.Thread(target=self._mic_loop, name="voice-mic", daemon=True),
                         threading.Thread(target=self._reply_loop, name="voice-reply",
                                          daemon=True)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._interrupt()
        self._drop_preemption()
        self._utterances.put(None)
        for t in self._threads:
            t.join(timeout)
        if self.runtime is not None:
            self.runtime.close()
        for stream in self.owned:
            stream.close()

    def __enter__(self) -> "VoiceAgent":
        try:
            return self.start()
        except BaseException:  # e.g. a failed warm-up: still close the streams and runtimes
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def track_reply(self, handle: Any) -> None:
        """Makes ``handle`` the request a barge-in cancels; cancels it at once if the user
        already spoke over this turn."""
        with self._lock:
            self._handle = handle
            if self._cancel.is_set():
                handle.cancel()

    @property
    def interrupted(self) -> bool:
        """Whether a barge-in cut the reply being played."""
        return self._cancel.is_set()

    def stats(self) -> VoiceStats:
        """Per-stage latency over the turns so far."""
        return VoiceStats([t for t in self.turns if t.done.is_set()])

    @property
    def speaking(self) -> bool:
        """A reply is being produced, queued or played."""
        return self._current is not None or self.output.queued > 0

    # ---- mic thread ------------------------------------------------------------------------

    def _mic_loop(self) -> None:
        from mstar_rt.audio.vad import VADNode
        from mstar_rt.runtime import Runtime

        reader = MicReader(self.input, self._stop)
        node = VADNode(input_name="mic", vad=self.vad, endpointer=self.endpointer,
                       speech_name="speech" if self.partial is not None else None)
        partial = None
        if self.partial is not None:
            from mstar_rt.audio.asr_stream import PartialASRNode
            partial = PartialASRNode(self.partial)
        try:
            with Runtime(ListenModel(reader, node, partial), poll_s=0.01) as listen:
                self.listen_runtime = listen
                # One request for the whole session: its outputs are not kept once read.
                for name, value in listen.submit({}, keep_outputs=False):
                    if name == "partials":
                        self._on_partials(value)
                        continue
                    now = time.monotonic()
                    self.windows += 1
                    for ev in value:
                        t = reader.clock.time_of(ev.sample)
                        if t != t:  # no callback logged (a fake input): "now" is the newest
                            t = now - (reader.heard - ev.sample) / RATE
                        self._on_event(ev, t, now)
        except Exception as e:  # a dead mic thread must show, not hang the caller
            self.errors.append(f"mic: {type(e).__name__}: {e}")
            raise

    def _on_event(self, ev: Any, t: float, now: float) -> None:
        if ev.kind == "start":
            self._speech_start = t
            self._utt, self._pause, self._partial = self._utt + 1, None, None
            self._drop_preemption()
            self._wasted, self._cancelled = 0.0, 0
            # Without barge-in the agent is half-duplex: speech heard while it talks (its own
            # voice, without headphones) is not a turn.
            self._deaf = self.speaking and not self.barge_in
            if self.barge_in and self.speaking:
                self._interrupt(now)
        elif ev.kind == "pause":
            self._pause = ev.sample
            self._check_complete()
            if self.preemptive and not self._deaf and not self._stop.is_set():
                self._drop_preemption()
                self._preempt = self._submit(ev.audio, ev.sample, self._guess())
        elif ev.kind == "resume":
            self._pause = None
            self._drop_preemption()
        elif ev.kind == "end" and not self._deaf:
            self._pause = None
            turn = Turn(len(self.turns), self._speech_start, t, now)
            turn.partial = self._partial.text if self._partial is not None else ""
            stream, self._preempt = self._preempt, None
            if stream is not None and stream.pause_sample != ev.sample:
                self._preempt = stream
                self._drop_preemption()
                stream = None
            turn.preemptive = stream is not None
            turn.wasted_preemptive_s, turn.cancelled_preemptive = self._wasted, self._cancelled
            self.turns.append(turn)
            self._utterances.put((turn, np.asarray(ev.audio, np.float32), stream))

    def _submit(self, audio: np.ndarray, pause: Optional[int] = None,
                guess: Optional[str] = None, text: Optional[str] = None) -> ReplyStream:
        assert self.runtime is not None
        # text: already recognized, the reply starts from it
        inputs = {"audio": audio, **({"guess": guess} if guess is not None else {}),
                  **({"text": text} if text is not None else {})}
        return ReplyStream(self.runtime.submit(inputs), pause, self._on_text, guess)

    def _guess(self) -> Optional[str]:
        """The streaming recognizer's hypothesis at this pause when it is a whole command and
        the reply walk can start from text: the reply then starts without waiting for the batch
        recognition, which still decides (a different text restarts the reply)."""
        p, pause = self._partial, self._pause
        if p is None or pause is None or p.position < pause or self.complete is None \
                or not p.text or not self.complete(p.text):
            return None
        assert self.runtime is not None
        return p.text if "guess" in self.runtime.model.walks else None

    def _drop_preemption(self) -> None:
        """Cancels the reply started at a pause the user spoke through."""
        stream, self._preempt = self._preempt, None
        if stream is not None:
            self._wasted += stream.cancel()
            self._cancelled += 1

    def _trusted(self, text: str) -> bool:
        """Whether a batch recognition overrules the guess (a whole command by construction).
        A grammar decode whose search never reached the grammar's end returns the path it got
        to ("close the"): no sentence of the grammar, so the live decode's whole one stands."""
        return self.complete is None or self.complete(text)

    def _on_text(self, stream: ReplyStream, text: str) -> None:
        """A preemptive recognition (without a streaming recognizer): a whole utterance ends
        the turn sooner."""
        if self.partial is None and self.complete is not None \
                and stream.pause_sample is not None and self.complete(text):
            self.endpointer.complete(stream.pause_sample)

    def _on_partials(self, partials: list) -> None:
        for p in partials:
            if p.utterance == self._utt:
                self._partial = p
        self._check_complete()

    def _check_complete(self) -> None:
        """In a pause, a partial hypothesis that has heard the pause and reads as a whole
        utterance lets the endpointer end sooner."""
        p, pause = self._partial, self._pause
        if pause is not None and p is not None and p.position >= pause \
                and self.complete is not None and self.complete(p.text):
            self.endpointer.complete(pause)

    def _interrupt(self, now: Optional[float] = None) -> None:
        """Barge-in: cancel the request, drop what is queued for the speaker."""
        with self._lock:
            turn, handle = self._current, self._handle
            self._cancel.set()
        if handle is not None:
            handle.cancel()
        before = self.output.flushed
        self.output.flush(timeout=0.5)
        if turn is not None and now is not None:
            turn.barged_in, turn.barge_in_at = True, now
            turn.flushed_frames += self.output.flushed - before
        elif now is not None and self.turns:  # reply fully produced, still playing
            last = self.turns[-1] if self.turns[-1].done.is_set() else None
            if last is not None and last.written_frames:
                last.barged_in, last.barge_in_at = True, now
                last.flushed_frames += self.output.flushed - before

    # ---- reply thread ----------------------------------------------------------------------

    def _reply_loop(self) -> None:
        while True:
            item = self._utterances.get()
            if item is None:
                return
            turn, audio, stream = item
            if self._stop.is_set():  # stopping: queued turns go unanswered (they played on)
                if stream is not None:
                    stream.cancel()
                turn.error = "the agent stopped before this turn was answered"
                turn.done.set()
                continue
            try:
                self._reply(turn, audio, stream)
            except Exception as e:
                turn.error = f"{type(e).__name__}: {e}"
                self.errors.append(turn.error)
            finally:
                with self._lock:
                    self._current = self._handle = None
                turn.done.set()

    def _chunks(self, turn: Turn, audio: np.ndarray, stream: Optional[ReplyStream]):
        """(text, reply, audio chunks) of the reply, via the Runtime or plain calls."""
        if self.runtime is None:
            turn.submitted = time.monotonic()
            turn.text = self.asr.recognize(audio).text
            turn.recognized_at = time.monotonic()
            turn.reply = self.responder(turn.text)
            turn.replied_at = time.monotonic()
            chunks = iter(self.tts.synthesize_stream(turn.reply))
            try:
                for chunk in chunks:
                    if self._cancel.is_set():
                        return
                    if np.isnan(turn.first_audio):
                        turn.first_audio = time.monotonic()
                    yield chunk
            finally:  # an iterator with a request in flight (Orpheus) cancels it
                getattr(chunks, "close", lambda: None)()
            return
        from mstar_rt.runtime import RequestCancelled

        if stream is None:
            stream = self._submit(audio)
        while True:
            if turn.submitted != turn.submitted:  # NaN: the first request counts (a retry
                turn.submitted = stream.submitted  # after a wrong guess keeps its recognition)
            self.track_reply(stream.handle)
            # A watchdog turns a hung request into a cancelled one instead of a hung thread.
            timer = threading.Timer(self.reply_timeout, stream.handle.cancel)
            timer.daemon = True
            timer.start()
            # A reply started from a guess plays only once the recognition says the same.
            confirmed, held = stream.guess is None, []
            try:
                for name, value in stream:
                    if name == "text":
                        turn.text, turn.recognized_at = value, stream.recognized_at
                        if not confirmed and value != stream.guess and self._trusted(value):
                            break
                        if not confirmed:  # agreed, or a failed decode against a whole guess
                            turn.text = stream.guess
                            confirmed = turn.guessed = True
                            yield from held
                    elif name == "reply":
                        turn.reply, turn.replied_at = value, stream.replied_at
                    elif name == "audio_out" and len(value):
                        turn.first_audio = stream.first_audio
                        if confirmed:
                            yield value
                        else:
                            held.append(value)
                if confirmed:
                    stream.join(1.0)
                    turn.trace = stream.handle.chrome_trace()
                    return
            except RequestCancelled:
                if not self._cancel.is_set():
                    raise TimeoutError(f"reply took over {self.reply_timeout} s")
                return
            finally:
                timer.cancel()
            # The guess was wrong: that reply is wasted work; start again from the recognition.
            turn.wasted_preemptive_s += stream.cancel()
            turn.cancelled_preemptive += 1
            turn.reply, turn.replied_at, turn.first_audio = "", float("nan"), float("nan")
            stream = self._submit(audio, text=turn.text if "said" in self.runtime.model.walks
                                  else None)

    def _reply(self, turn: Turn, audio: np.ndarray, stream: Optional[ReplyStream]) -> None:
        out = self.output
        with self._lock:
            if not self._stop.is_set():  # (a stop's cancel holds for what comes after it)
                self._cancel.clear()
            self._current = turn
        epoch = out.epoch
        under0 = out.underruns
        first_frame = None
        chunks = self._chunks(turn, audio, stream)
        pending = next(chunks, None)
        while pending is not None and not self._cancel.is_set():
            if first_frame is None:
                first_frame = out.counters()["written"]
            n = out.write(pending, timeout=self.reply_timeout, end=False, epoch=epoch)
            if n and np.isnan(turn.first_write):
                turn.first_write = time.monotonic()
            turn.written_frames += n
            pending = next(chunks, None)
            if math.isnan(turn.first_dac):  # a long reply outlasts the callback log
                turn.first_dac = dac_time(out, first_frame)
        chunks.close()
        out.end()
        if first_frame is not None and turn.written_frames and math.isnan(turn.first_dac):
            # timed as soon as it plays: the callback log keeps only ~10 s of blocks
            turn.first_dac = self._played_at(first_frame)
        if not self._cancel.is_set() and turn.written_frames:
            # Stay "current" (barge-in target) until played; the device needs the frames.
            out.drain(timeout=self.reply_timeout)
            time.sleep(max(out.latency, 0.0))
        turn.underruns = out.underruns - under0
        if first_frame is not None and turn.written_frames and math.isnan(turn.first_dac):
            turn.first_dac = dac_time(out, first_frame)

    def _played_at(self, frame: int, timeout: float = 2.0) -> float:
        """When the device played output frame ``frame``; NaN on barge-in or ``timeout``."""
        end = time.monotonic() + timeout
        while not self._cancel.is_set():
            t = dac_time(self.output, frame)
            if not math.isnan(t) or time.monotonic() > end:
                return t
            time.sleep(0.005)
        return float("nan")


def open_agent(mic_source: Optional[str] = None, speaker_sink: Optional[str] = None,
               rate: int = 48000, blocksize: int = 480, tts: Optional[TTS] = None,
               responder: Optional[Callable[[str], str]] = None, output_latency: float = 0.1,
               asr: Any = None, **kwargs: Any) -> VoiceAgent:
    """An agent on its own streams: PulseAudio ``mic_source``/``speaker_sink`` (the virtual
    devices) or, when both are None, the default devices; Silero VAD, PocketSphinx with the robot
    command grammar, :class:`CommandResponder`, and Piper (espeak-ng without it) unless given
    (e.g. ``asr=WhisperASR(dir)``, ``responder=LMResponder(dir)``,
    ``tts=OrpheusSpeech.tiny()``; the output resamples ``tts.sample_rate`` to ``rate``).
    Adaptive endpointing judges a recognition whole by the recognizer's grammar when it has one,
    else by a final '.', '?' or '!'.
    ``stop()`` closes the streams. Imports sounddevice: start virtual devices first."""
    from mstar_rt.audio import devices
    from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF, PocketSphinxASR
    from mstar_rt.audio.tts import default_tts
    from mstar_rt.audio.vad import Endpointer, SileroVAD

    tts = tts or default_tts()
    asr = asr if asr is not None else PocketSphinxASR(ROBOT_COMMANDS_JSGF)
    grammar = getattr(asr, "grammar", None) if isinstance(asr, PocketSphinxASR) else None
    if "complete" not in kwargs:  # a grammar says what is whole; else a finished sentence is
        kwargs["complete"] = CommandGrammar(grammar).complete if grammar else ends_sentence
    if "partial" not in kwargs and grammar is not None:
        from mstar_rt.audio.asr_stream import PartialRecognizer
        kwargs["partial"] = PartialRecognizer(grammar)
    vad, endpointer = SileroVAD(RATE), Endpointer(sample_rate=RATE, window=WINDOW)
    inp = devices.AudioInput(rate, blocksize=blocksize, pulse_source=mic_source,
                             target_rate=RATE, ring_seconds=8.0)
    # 100 ms of device buffering rides out scheduling stalls on a loaded machine.
    out = devices.AudioOutput(rate, blocksize=blocksize, pulse_sink=speaker_sink,
                              source_rate=tts.sample_rate, latency=output_latency,
                              ring_seconds=60.0)
    agent = VoiceAgent(inp, out, vad, endpointer, asr, responder or CommandResponder(), tts,
                       **kwargs)
    agent.owned = [inp, out]
    return agent
