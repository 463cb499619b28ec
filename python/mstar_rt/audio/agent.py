"""A live speech-to-speech agent: microphone → VAD/endpointer → recognition → response → TTS →
speaker, with barge-in.

Listening is a walk graph too: :class:`ListenModel` is one long request whose ``mic`` node (a
DynamicLoop on its own engine) reads one 32 ms block per iteration and streams it, one block per
``Fixed(1)`` window, into the ``vad`` node (Silero + endpointer), which EMITs the endpointer's
events. The agent's mic thread only turns those events into turns; it never waits on the reply,
so it hears the user while the agent talks. The reply thread submits each utterance to a
Runtime serving :class:`ReplyModel` (walk ``asr → respond → DynamicLoop(tts)``, EMITting the
text, the reply and the audio chunks as the TTS makes them; with an LM responder the LM's
decode loop streams into a sentence splitter that feeds the speech loop) and streams the chunks
into the speaker ring as they come.
Barge-in (speech starting while a reply is queued or playing) cancels the request in the
Conductor and flushes the output ring, and writes tagged with the old epoch are dropped.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from mstar_rt.graph import (EMIT, DynamicLoop, GraphEdge, GraphNode, Parallel, Sequential,
                            StreamingGraphEdge)
from mstar_rt.model import Model, NodeSubmodule
from mstar_rt.audio.commands import CommandResponder
from mstar_rt.audio.speak import SpeakNode
from mstar_rt.audio.tts import TTS

RATE = 16000  # VAD and recognizer rate
WINDOW = 512  # 32 ms

# ---- the reply walk ------------------------------------------------------------------------

class _Call(NodeSubmodule):
    """``out = fn(inp)`` per item, one item per forward (each is a whole utterance)."""

    max_batch = 1

    def __init__(self, fn: Callable[[Any], Any], inp: str, out: str) -> None:
        self.fn, self.inp, self.out = fn, inp, out

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        return [{self.out: self.fn(x[self.inp])} for x in batch]


class ReplyModel(Model):
    """Input ``audio`` (16 kHz float32 utterance); EMITs ``text`` (the recognition), ``reply``
    and the ``audio_out`` chunks at ``tts.sample_rate`` as they are made (one a sentence for
    Piper / espeak-ng). Cancelling the request stops it at the next chunk.

    With a deterministic ``responder`` the walk is ``asr -> respond -> DynamicLoop(tts)``. With
    an LM responder (:class:`~mstar_rt.audio.lm_responder.LMResponder`) the LM is part of the
    walk graph: ``reply = asr -> chat -> prefill``, then ``speak = Parallel(DynamicLoop(decode),
    split, DynamicLoop(tts))``, the decode node streaming tokens (also EMITted as ``token``)
    into the sentence splitter, which feeds the speech loop sentence by sentence and EMITs the
    ``reply`` so far; the KV pages are freed when the request ends, cancelled or not.
    ``max_sentences`` caps the speech loop's iterations (one a chunk)."""

    inputs = ("audio",)

    def __init__(self, asr: Any, responder: Callable[[str], str], tts: TTS,
                 max_sentences: int = 2**31 - 1) -> None:
        recognize = _Call(lambda a: asr.recognize(np.asarray(a, np.float32)).text, "audio", "text")
        if getattr(responder, "is_lm", False):
            self._lm_walks(recognize, responder, tts)
            return
        self.nodes = [
            GraphNode("asr", ["audio"], [GraphEdge(EMIT, "text")], submodule=recognize),
            GraphNode("respond", ["text"], [GraphEdge(EMIT, "reply")],
                      submodule=_Call(responder, "text", "reply")),
            GraphNode("tts", ["reply"], [GraphEdge(EMIT, "audio_out")],
                      submodule=SpeakNode(tts, loop="speak", text="reply"), engine="tts")]
        self.walks = {"reply": Sequential("asr", "respond",
                                          DynamicLoop("tts", max_sentences, "speak"))}

    def _lm_walks(self, asr: NodeSubmodule, lm: Any, tts: TTS) -> None:
        from mstar_rt.audio.lm_responder import ChatPrompt, SentenceSplitter
        from mstar_rt.models.causal_lm import LOOP
        from mstar_rt.streaming import Fixed

        node = lm.lm_node()
        self.nodes = [
            GraphNode("asr", ["audio"], [GraphEdge(EMIT, "text"), "text"], submodule=asr),
            GraphNode("chat", ["text"], ["prompt", "params"], submodule=ChatPrompt(lm)),
            GraphNode("prefill", ["prompt", "params"],
                      [GraphEdge("decode", "token", persist=True)], submodule=node, engine="lm"),
            GraphNode("decode", ["token"], [GraphEdge(EMIT, "token"), "token",
                                            StreamingGraphEdge("split", "token", Fixed(1))],
                      submodule=node, engine="lm"),
            GraphNode("split", ["token"], [GraphEdge(EMIT, "reply")],
                      submodule=SentenceSplitter(lm)),
            GraphNode("tts", [], [GraphEdge(EMIT, "audio_out")],
                      submodule=SpeakNode(tts, text=None), engine="tts"),
        ]
        self.walks = {"reply": Sequential("asr", "chat", "prefill"),
                      "speak": Parallel(DynamicLoop("decode", lm.max_seq_len, LOOP), "split",
                                        DynamicLoop("tts", 2**31 - 1, "speak"))}
        self.engine_specs = {"lm": lm.engine()}

    def next_walk(self, request: Any, finished_walk: str, persisted: Any) -> Optional[str]:
        if finished_walk == "reply" and "speak" in self.walks:
            return "speak"
        return None


class _MicReader(NodeSubmodule):
    """Loop body of the listen walk: the next 32 ms block of 16 kHz samples per iteration."""

    max_batch = 1

    def __init__(self, input: Any, stopped: threading.Event) -> None:
        self.input, self.stopped = input, stopped
        self.device_block = int(round(WINDOW * input.samplerate / RATE))
        self._buf = np.zeros(0, np.float32)
        self.heard = 0  # 16 kHz samples handed to the graph so far

    def forward(self, batch: list[Any]) -> list[dict[str, Any]]:
        while len(self._buf) < WINDOW and not self.stopped.is_set():
            try:
                x = self.input.read(self.device_block, timeout=0.5)
            except TimeoutError:
                continue
            self._buf = np.concatenate([self._buf, np.asarray(x, np.float32).reshape(-1)])
        if len(self._buf) < WINDOW:  # stopping: pad the last block
            self._buf = np.concatenate([self._buf, np.zeros(WINDOW - len(self._buf), np.float32)])
        block, self._buf = self._buf[:WINDOW], self._buf[WINDOW:]
        self.heard += WINDOW
        return [{"mic": block} for _ in batch]

    def check_stop(self, batch: list[Any], outputs: list[Any]) -> list[Any]:
        return [("listen",) if self.stopped.is_set() else () for _ in batch]


class ListenModel(Model):
    """One request per session: ``mic`` (DynamicLoop "listen", engine ``mic``) streams 32 ms
    blocks through ``Fixed(1)`` windows into ``vad`` (engine ``vad``), which EMITs ``events``
    (the endpointer's VADEvents of that window; utterance audio on "end")."""

    inputs = ()

    def __init__(self, reader: _MicReader, vad_node: Any) -> None:
        from mstar_rt.streaming import Fixed

        self.nodes = [GraphNode("mic", [], [StreamingGraphEdge("vad", "mic", Fixed(1))],
                                submodule=reader, engine="mic"),
                      GraphNode("vad", ["mic"], [GraphEdge(EMIT, "events"), "vad"],
                                submodule=vad_node, engine="vad")]
        self.walks = {"listen": Parallel(DynamicLoop("mic", 2**31 - 1, "listen"), "vad")}


# ---- records -------------------------------------------------------------------------------

@dataclass
class Turn:
    """One user utterance and the agent's reply; times are time.monotonic() seconds."""

    index: int
    speech_start: float
    speech_end: float  # the endpointer's last speech sample, mapped to wall time
    detected: float  # when the endpointer declared the end (speech_end + its silence wait)
    text: str = ""
    reply: str = ""
    recognized_at: float = float("nan")
    first_write: float = float("nan")  # first reply sample handed to the output ring
    first_dac: float = float("nan")  # ... and when the device played it (PortAudio clock)
    written_frames: int = 0  # device-rate frames queued for this reply
    underruns: int = 0  # output underruns while this reply was queued or playing
    barged_in: bool = False
    barge_in_at: float = float("nan")
    flushed_frames: int = 0  # frames of this reply dropped by the barge-in flush
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def latency_write(self) -> float:
        return self.first_write - self.speech_end

    @property
    def latency_dac(self) -> float:
        return self.first_dac - self.speech_end


def dac_time(output: Any, frame: int) -> float:
    """Monotonic time at which the output device plays device frame ``frame`` (counted like
    ``counters()["written"]``), from the callback log; NaN if not played (yet) or logged."""
    ts = output.timestamps()
    if not len(ts):
        return float("nan")
    # Idle callbacks keep the position: the block that played ``frame`` is the last one
    # starting at or before it, found through the first block that starts after it.
    later = np.nonzero(ts[:, 2] > frame)[0]
    if not len(later) or later[0] == 0:
        return float("nan")
    cur, dac, pos, mono = ts[later[0] - 1]
    return float(mono + (dac - cur) + (frame - pos) / output.samplerate)


# ---- the agent -----------------------------------------------------------------------------

class VoiceAgent:
    """``VoiceAgent(input, output, vad, endpointer, asr, responder, tts)``; ``start()``,
    ``stop()``, or use it as a context manager. ``turns`` lists :class:`Turn` records.

    ``input`` is an AudioInput whose ``target_rate`` is 16 kHz; ``output`` an AudioOutput whose
    ``source_rate`` is ``tts.sample_rate``. ``use_runtime=False`` runs the same steps as plain
    calls on the reply thread (no Conductor), for comparison.
    """

    def __init__(self, input: Any, output: Any, vad: Any, endpointer: Any, asr: Any,
                 responder: Callable[[str], str], tts: TTS, barge_in: bool = True,
                 use_runtime: bool = True, reply_timeout: float = 30.0) -> None:
        if getattr(input, "target_rate", RATE) != RATE:
            raise ValueError(f"the input must deliver {RATE} Hz (AudioInput(target_rate={RATE}))")
        if getattr(output, "source_rate", tts.sample_rate) != tts.sample_rate:
            raise ValueError(f"the output must take the TTS rate {tts.sample_rate} Hz "
                             f"(AudioOutput(source_rate={tts.sample_rate}))")
        self.input, self.output = input, output
        self.vad, self.endpointer, self.asr = vad, endpointer, asr
        self.responder, self.tts = responder, tts
        self.barge_in, self.reply_timeout = barge_in, reply_timeout
        self.runtime = None
        if use_runtime:
            from mstar_rt.runtime import Runtime
            self.runtime = Runtime(ReplyModel(asr, responder, tts), poll_s=0.01)
        self.turns: list[Turn] = []
        self.owned: list[Any] = []  # streams stop() closes (set by open_agent)
        self.windows = 0  # VAD windows processed
        self.errors: list[str] = []
        self._utterances: "queue.Queue[Optional[tuple[Turn, np.ndarray]]]" = queue.Queue()
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

    @property
    def speaking(self) -> bool:
        """A reply is being produced, queued or played."""
        return self._current is not None or self.output.queued > 0

    # ---- mic thread ------------------------------------------------------------------------

    def _mic_loop(self) -> None:
        from mstar_rt.audio.vad import VADNode
        from mstar_rt.runtime import Runtime

        reader = _MicReader(self.input, self._stop)
        node = VADNode(input_name="mic", vad=self.vad, endpointer=self.endpointer)
        try:
            with Runtime(ListenModel(reader, node), poll_s=0.01) as listen:
                self.listen_runtime = listen
                # One request for the whole session: its outputs are not kept once read.
                for _name, events in listen.submit({}, keep_outputs=False):
                    now = time.monotonic()
                    self.windows += 1
                    for ev in events:
                        # The newest block handed to the graph was captured about "now".
                        t = now - (reader.heard - ev.sample) / RATE
                        self._on_event(ev, t, now)
        except Exception as e:  # a dead mic thread must show, not hang the caller
            self.errors.append(f"mic: {type(e).__name__}: {e}")
            raise

    def _on_event(self, ev: Any, t: float, now: float) -> None:
        if ev.kind == "start":
            self._speech_start = t
            # Without barge-in the agent is half-duplex: speech heard while it talks (its own
            # voice, without headphones) is not a turn.
            self._deaf = self.speaking and not self.barge_in
            if self.barge_in and self.speaking:
                self._interrupt(now)
        elif ev.kind == "end" and not self._deaf:
            turn = Turn(len(self.turns), self._speech_start, t, now)
            self.turns.append(turn)
            self._utterances.put((turn, np.asarray(ev.audio, np.float32)))

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
            turn, audio = item
            try:
                self._reply(turn, audio)
            except Exception as e:
                turn.error = f"{type(e).__name__}: {e}"
                self.errors.append(turn.error)
            finally:
                with self._lock:
                    self._current = self._handle = None
                turn.done.set()

    def _chunks(self, turn: Turn, audio: np.ndarray):
        """(text, reply, audio chunks) of the reply, via the Runtime or plain calls."""
        if self.runtime is None:
            turn.text = self.asr.recognize(audio).text
            turn.recognized_at = time.monotonic()
            turn.reply = self.responder(turn.text)
            chunks = iter(self.tts.synthesize_stream(turn.reply))
            try:
                for chunk in chunks:
                    if self._cancel.is_set():
                        return
                    yield chunk
            finally:  # an iterator with a request in flight (Orpheus) cancels it
                getattr(chunks, "close", lambda: None)()
            return
        from mstar_rt.runtime import RequestCancelled

        handle = self.runtime.submit({"audio": audio})
        with self._lock:
            self._handle = handle
            if self._cancel.is_set():
                handle.cancel()
        # A watchdog turns a hung request into a cancelled one instead of a hung thread.
        timer = threading.Timer(self.reply_timeout, handle.cancel)
        timer.daemon = True
        timer.start()
        try:
            for name, value in handle:
                if name == "text":
                    turn.text, turn.recognized_at = value, time.monotonic()
                elif name == "reply":
                    turn.reply = value
                elif name == "audio_out" and len(value):
                    yield value
        except RequestCancelled:
            if not self._cancel.is_set():
                raise TimeoutError(f"reply took over {self.reply_timeout} s")
        finally:
            timer.cancel()

    def _reply(self, turn: Turn, audio: np.ndarray) -> None:
        out = self.output
        with self._lock:
            self._cancel.clear()
            self._current = turn
        epoch = out.epoch
        under0 = out.underruns
        first_frame = None
        chunks = self._chunks(turn, audio)
        pending = next(chunks, None)
        while pending is not None and not self._cancel.is_set():
            if first_frame is None:
                first_frame = out.counters()["written"]
            n = out.write(pending, timeout=self.reply_timeout, end=False, epoch=epoch)
            if n and np.isnan(turn.first_write):
                turn.first_write = time.monotonic()
            turn.written_frames += n
            pending = next(chunks, None)
        chunks.close()
        out.end()
        if not self._cancel.is_set() and turn.written_frames:
            # Stay "current" (barge-in target) until played; the device needs the frames.
            out.drain(timeout=self.reply_timeout)
            time.sleep(max(out.latency, 0.0))
        turn.underruns = out.underruns - under0
        if first_frame is not None and turn.written_frames:
            turn.first_dac = dac_time(out, first_frame)


def open_agent(mic_source: Optional[str] = None, speaker_sink: Optional[str] = None,
               rate: int = 48000, blocksize: int = 480, tts: Optional[TTS] = None,
               responder: Optional[Callable[[str], str]] = None, output_latency: float = 0.1,
               asr: Any = None, **kwargs: Any) -> VoiceAgent:
    """An agent on its own streams: PulseAudio ``mic_source``/``speaker_sink`` (the virtual
    devices) or, when both are None, the default devices; Silero VAD, PocketSphinx with the robot
    command grammar, :class:`CommandResponder`, and Piper (espeak-ng without it) unless given
    (e.g. ``asr=WhisperASR(dir)``, ``responder=LMResponder(dir)``,
    ``tts=OrpheusSpeech.tiny()``; the output resamples ``tts.sample_rate`` to ``rate``).
    ``stop()`` closes the streams. Imports sounddevice: start virtual devices first."""
    from mstar_rt.audio import devices
    from mstar_rt.audio.asr import ROBOT_COMMANDS_JSGF, PocketSphinxASR
    from mstar_rt.audio.tts import default_tts
    from mstar_rt.audio.vad import Endpointer, SileroVAD

    tts = tts or default_tts()
    asr = asr if asr is not None else PocketSphinxASR(ROBOT_COMMANDS_JSGF)
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
