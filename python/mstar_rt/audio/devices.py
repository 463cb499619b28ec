"""PortAudio streams (sounddevice) whose callbacks only move samples between the device buffer and
a C++ SPSC ring.

The callbacks copy with numpy slice assignment from ring views (``peek``/``release``) or push the
device buffer straight into the ring: no buffer allocation, no lock, no wait, no model work.
Everything else — resampling, blocking, flush bookkeeping — runs on the producer/consumer side.
Cross-thread flags are plain attributes: each is written by one side, and the GIL orders them.

PortAudio enumerates devices once, when sounddevice is imported: ALSA's ``pulse`` device (used
with ``pulse_sink``/``pulse_source``) is listed only if PulseAudio was running by then
(scripts/virtual_audio.sh starts it).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import sounddevice as sd

from mstar_rt.audio.resample import Resampler
from mstar_rt.streaming import Ring

FLAG_NAMES = ("input_underflow", "input_overflow", "output_underflow", "output_overflow",
              "priming_output")
_LOG = 1024  # callbacks of timestamps kept (about 10 s at 10 ms blocks)


def _capacity(frames: float) -> int:
    return 1 << max(4, int(np.ceil(np.log2(max(frames, 16)))))


@contextmanager
def _pulse_env(var: str, value: str | None) -> Iterator[None]:
    """The ALSA ``pulse`` device picks its sink/source from PULSE_SINK/PULSE_SOURCE when the
    stream opens (libpulse reads them then), so set them just around the open."""
    old = os.environ.get(var)
    if value is not None:
        os.environ[var] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                del os.environ[var]
            else:
                os.environ[var] = old


class _Stream:
    """Status-flag counts and a log of PortAudio timestamps, both preallocated."""

    def __init__(self) -> None:
        self.flag_counts = dict.fromkeys(FLAG_NAMES, 0)
        self.callbacks = 0
        # Per callback: PortAudio currentTime, buffer DAC/ADC time, stream frame position of the
        # block's first frame, time.monotonic() — the last maps stream time to wall time.
        self._tlog = np.zeros((_LOG, 4))
        self._stream: sd._StreamBase

    def _note(self, status: sd.CallbackFlags, now: float, buffer_time: float, pos: int) -> None:
        if status:
            for name in FLAG_NAMES:
                if getattr(status, name):
                    self.flag_counts[name] += 1
        row = self._tlog[self.callbacks % _LOG]
        row[0] = now
        row[1] = buffer_time
        row[2] = pos
        row[3] = time.monotonic()
        self.callbacks += 1

    def timestamps(self) -> np.ndarray:
        """``[n, 4]`` rows (current_time, buffer_time, frame_position, monotonic), oldest first."""
        n = self.callbacks
        log = self._tlog.copy()
        return log[:n] if n <= _LOG else np.roll(log, -(n % _LOG), axis=0)

    def device_latency_s(self) -> float:
        """Median of buffer_time - current_time over the logged callbacks: how far ahead of
        "now" the device plays (output) or how long ago it captured (input, negated)."""
        ts = self.timestamps()
        return float(np.median(np.abs(ts[:, 1] - ts[:, 0]))) if len(ts) else float("nan")

    @property
    def latency(self) -> float:
        return float(self._stream.latency)

    def start(self) -> None:
        self._stream.start()

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AudioOutput(_Stream):
    """Plays float32 samples written from a producer thread.

    ``write()`` queues samples (resampled from ``source_rate`` when it differs), ``flush()`` drops
    everything queued within one block (barge-in). A write that is part of an utterance which
    continues should pass ``end=False``; the callback then counts an empty or short block as an
    underrun, while after ``end=True`` (or a flush) it is idle, not an underrun.
    """

    def __init__(self, samplerate: int, channels: int = 1, blocksize: int = 480,
                 device: int | str | None = None, ring_seconds: float = 4.0,
                 source_rate: int | None = None, latency: float | str = "low",
                 pulse_sink: str | None = None, start: bool = True) -> None:
        super().__init__()
        self.samplerate, self.channels, self.blocksize = samplerate, channels, blocksize
        self.source_rate = source_rate or samplerate
        # mirror = blocksize: one peek covers a whole block even across the wrap.
        self._ring = Ring(np.float32, _capacity(ring_seconds * samplerate), (channels,),
                          "block", blocksize)
        self._resampler = self._new_resampler()
        self._resampler_gen = 0  # the flush generation its history belongs to
        self._write_lock = threading.Lock()
        self._write_pos = 0  # frames pushed (writer)
        self._read_pos = 0  # frames taken out of the ring, played or dropped (callback)
        self._open = False  # an utterance is in progress (writer, flush)
        # Flush handshake: flush() bumps _flush_gen; the writer acknowledges with the ring
        # position after its last push of stale audio (_ack_pos, then _ack_gen); the callback
        # drops everything until acknowledged, then exactly up to _ack_pos.
        self._flush_gen = self._ack_gen = self._drained_gen = 0
        self._ack_pos = 0
        self.played = 0  # frames of queued audio sent to the device
        self.flushed = 0  # frames dropped by flushes
        self.underruns = 0  # blocks short of samples mid-utterance
        self.underrun_frames = 0
        self.idle_blocks = 0  # blocks with nothing queued and no utterance open
        # device underflows (the callback came late) with a reply playing: audible gaps
        self.audible_xruns = 0
        if device is None and pulse_sink is not None:
            device = "pulse"
        with _pulse_env("PULSE_SINK", pulse_sink):
            self._stream = sd.OutputStream(samplerate=samplerate, blocksize=blocksize,
                                           device=device, channels=channels, dtype="float32",
                                           latency=latency, callback=self._callback)
        if start:
            self.start()

    def _new_resampler(self) -> Resampler | None:
        if self.source_rate == self.samplerate:
            return None
        return Resampler(self.source_rate, self.samplerate, self.channels)

    # ---- audio thread ----------------------------------------------------------------------

    def _drop(self, count: int) -> None:
        ring = self._ring
        while count > 0:
            n = len(ring.peek(count))
            ring.release(n)
            if n == 0:
                break
            count -= n
            self._read_pos += n
            self.flushed += n

    def _callback(self, outdata: np.ndarray, frames: int, t: Any, status: sd.CallbackFlags) -> None:
        self._note(status, t.currentTime, t.outputBufferDacTime, self._read_pos)
        gen = self._flush_gen
        if gen != self._drained_gen:
            if self._ack_gen == gen:
                self._drop(self._ack_pos - self._read_pos)
                self._drained_gen = gen
            else:  # the writer may still push stale audio: drop what is there, play silence
                self._drop(len(self._ring))
                outdata.fill(0)
                return
        ring, filled = self._ring, 0
        while filled < frames:
            view = ring.peek(frames - filled)
            n = len(view)
            if n == 0:
                break
            outdata[filled:filled + n] = view
            ring.release(n)
            filled += n
        self._read_pos += filled
        self.played += filled
        if status and status.output_underflow and (filled or self._open):
            self.audible_xruns += 1
        if filled < frames:
            outdata[filled:].fill(0)
            if self._open:
                self.underruns += 1
                self.underrun_frames += frames - filled
            elif filled == 0:
                self.idle_blocks += 1

    # ---- producer side ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Changes at every flush; pass it to write() to have audio of a cancelled reply dropped."""
        return self._flush_gen

    @property
    def queued(self) -> int:
        """Frames written but not yet handed to the device."""
        return len(self._ring)

    def _acknowledge(self) -> None:
        self._ack_pos = self._write_pos
        self._ack_gen = self._flush_gen

    def _frames(self, samples: Any) -> np.ndarray:
        """``[n]`` (mono) or ``[n, channels]`` float samples as float32 ``[n, channels]``;
        what a speaker should not play (integers read as floats are full-scale noise, NaN) is
        refused by name."""
        x = np.asarray(samples)
        if x.dtype.kind != "f":
            raise TypeError(f"AudioOutput.write takes float samples in [-1, 1], got {x.dtype}; "
                            "scale integer PCM by its full scale first (int16: x / 32768)")
        if not (x.ndim == 2 and x.shape[1] == self.channels
                or x.ndim == 1 and self.channels == 1):
            mono = "[n] or " if self.channels == 1 else ""
            raise ValueError(f"AudioOutput.write takes {mono}[n, {self.channels}] samples for "
                             f"this {self.channels}-channel output, got shape {list(x.shape)}")
        x = x.astype(np.float32, copy=False).reshape(len(x), self.channels)
        if not np.isfinite(x).all():
            at = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
            raise ValueError(f"sample {at} is NaN or infinite; a speaker must not play it")
        return x

    def write(self, samples: np.ndarray, timeout: float | None = None, end: bool = True,
              epoch: int | None = None) -> int:
        """Queues ``[n]`` or ``[n, channels]`` samples at ``source_rate``; blocks while the ring
        is full. Returns the device-rate frames queued: fewer after a flush (the rest is
        dropped) or when ``timeout`` passes. ``end=False`` says more of this utterance follows."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._write_lock.acquire(timeout=-1 if timeout is None else timeout):
            return 0
        try:
            if self._ack_gen != self._flush_gen:
                self._acknowledge()
            gen = self._flush_gen
            if epoch is not None and epoch != gen:
                return 0
            if self._resampler is not None and self._resampler_gen != gen:  # stale history
                self._resampler, self._resampler_gen = self._new_resampler(), gen
            x = self._frames(samples)
            if self._resampler is not None:
                x = self._resampler.process(x, last=end)
            x = np.ascontiguousarray(x)
            self._open = True
            done = 0
            while done < len(x):
                if self._flush_gen != gen:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                # Slices of one block: a flush is noticed within one block of waiting.
                step = min(len(x) - done, self.blocksize)
                wait = self.blocksize / self.samplerate if left is None else min(left, 0.05)
                n = self._ring.push(x[done:done + step], timeout=wait)
                self._write_pos += n
                done += n
            if self._flush_gen != gen:
                self._open = False
                self._acknowledge()
                return done
            self._open = not end
            return done
        finally:
            self._write_lock.release()

    def end(self) -> None:
        """The utterance is complete: running dry from now on is idle, not an underrun. Queues
        the end the resampler held back."""
        self.write(np.zeros((0, self.channels), np.float32))

    def flush(self, timeout: float | None = 1.0) -> bool:
        """Drops everything queued; the callback stops playing it at its next block. With a
        timeout, waits until the drop happened (True) or the timeout passed (False)."""
        self._open = False
        self._flush_gen += 1
        if self._write_lock.acquire(blocking=False):  # no writer: acknowledge for it
            try:
                self._acknowledge()
            finally:
                self._write_lock.release()
        if timeout is None:
            return True
        gen, deadline = self._flush_gen, time.monotonic() + timeout
        while self._drained_gen < gen:
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.blocksize / self.samplerate / 4)
        return True

    def drain(self, timeout: float) -> bool:
        """Waits until everything written has been handed to the device."""
        deadline = time.monotonic() + timeout
        while self._read_pos < self._write_pos:
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.blocksize / self.samplerate / 2)
        return True

    def counters(self) -> dict[str, Any]:
        return {"played": self.played, "written": self._write_pos, "flushed": self.flushed,
                "queued": self.queued, "underruns": self.underruns,
                "underrun_frames": self.underrun_frames, "idle_blocks": self.idle_blocks,
                "audible_xruns": self.audible_xruns,
                "callbacks": self.callbacks, "flags": dict(self.flag_counts)}


class AudioInput(_Stream):
    """Captures float32 samples into a ring; ``read()`` takes them out (resampled to
    ``target_rate`` when it differs). A full ring drops the new block (``overflow="reject"``,
    counted in ``overruns``) or the oldest samples (``"drop_oldest"``)."""

    def __init__(self, samplerate: int, channels: int = 1, blocksize: int = 480,
                 device: int | str | None = None, ring_seconds: float = 4.0,
                 target_rate: int | None = None, overflow: str = "reject",
                 latency: float | str = "low", pulse_source: str | None = None,
                 start: bool = True) -> None:
        super().__init__()
        if overflow not in ("reject", "drop_oldest"):
            raise ValueError("an audio callback cannot wait: overflow must be 'reject' or "
                             f"'drop_oldest', got {overflow!r}")
        self.samplerate, self.channels, self.blocksize = samplerate, channels, blocksize
        self.target_rate = target_rate or samplerate
        self._ring = Ring(np.float32, _capacity(ring_seconds * samplerate), (channels,), overflow)
        self._resampler = (None if self.target_rate == samplerate
                           else Resampler(samplerate, self.target_rate, channels))
        self.captured = 0  # frames the device delivered (stored or not)
        self.overruns = 0  # callbacks whose block did not fit the ring
        if device is None and pulse_source is not None:
            device = "pulse"
        with _pulse_env("PULSE_SOURCE", pulse_source):
            self._stream = sd.InputStream(samplerate=samplerate, blocksize=blocksize,
                                          device=device, channels=channels, dtype="float32",
                                          latency=latency, callback=self._callback)
        if start:
            self.start()

    def _callback(self, indata: np.ndarray, frames: int, t: Any, status: sd.CallbackFlags) -> None:
        self._note(status, t.currentTime, t.inputBufferAdcTime, self.captured)
        if self._ring.push(indata, 0.0) < frames:
            self.overruns += 1
        self.captured += frames

    @property
    def overrun_frames(self) -> int:
        s = self._ring.stats
        return int(s["rejected"] + s["dropped"])

    @property
    def available(self) -> int:
        return len(self._ring)

    def clear(self) -> int:
        """Drops what has been captured but not read (e.g. before listening anew)."""
        n = 0
        while len(self._ring):
            got = self._ring.pop(len(self._ring), 0.0)
            n += 0 if got is None else len(got)
        return n

    def read(self, frames: int, timeout: float) -> np.ndarray:
        """Exactly ``frames`` device-rate frames (returned at ``target_rate``), ``[n]`` for mono.
        Raises TimeoutError when they do not arrive in time."""
        deadline = time.monotonic() + timeout
        parts, got = [], 0
        while got < frames:
            left = deadline - time.monotonic()
            try:
                part = self._ring.pop(frames - got, max(left, 0.0))
            except TimeoutError:
                part = None
            if part is None:
                raise TimeoutError(f"read: {got} of {frames} frames arrived within {timeout} s")
            parts.append(part)
            got += len(part)
        x = np.concatenate(parts) if parts else np.zeros((0, self.channels), np.float32)
        if self._resampler is not None:
            x = self._resampler.process(x)
        return x[:, 0] if self.channels == 1 else x
