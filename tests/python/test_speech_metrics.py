"""Speech streaming metrics from arriving audio chunks: time to first (audible) audio, real-time
factor, chunk intervals and playback viability with its worst margin."""

import math
import time

import numpy as np
import pytest

from mstar_rt.audio.speech_metrics import SpeechMeter, SpeechMetrics

SR = 24000
FRAME = 2048  # one SNAC frame: 85.33 ms


def tone(n: int, amplitude: float = 0.3) -> np.ndarray:
    return (amplitude * np.sin(np.arange(n) / 7)).astype(np.float32)


def test_frames_arriving_faster_than_they_play_are_viable():
    # submit at 1.0; a frame every 80 ms from 1.2: each arrives 5.33 ms more ahead than the last
    events = [(1.2 + 0.08 * i, tone(FRAME)) for i in range(10)]
    m = SpeechMetrics.from_events(1.0, events, SR)
    assert m.ttfa_s == pytest.approx(0.2)
    assert m.audio_s == pytest.approx(10 * FRAME / SR)
    assert m.rtf == pytest.approx((1.2 + 0.72 - 1.0) / (10 * FRAME / SR))
    assert m.chunk_intervals_s == pytest.approx([0.08] * 9)
    assert m.viable and m.worst_margin_s == pytest.approx(FRAME / SR - 0.08)
    assert m.sample_rate == SR


def test_frames_arriving_slower_than_they_play_underrun():
    events = [(0.1 * (i + 1), tone(FRAME)) for i in range(10)]  # every 100 ms > 85.3 ms
    m = SpeechMetrics.from_events(0.0, events, SR)
    assert not m.viable
    assert m.worst_margin_s == pytest.approx(9 * (FRAME / SR - 0.1))  # the last one is latest
    assert m.rtf > 1


def test_a_big_first_chunk_buys_slack_for_a_late_one():
    events = [(0.5, tone(3 * FRAME)), (0.7, tone(FRAME)), (0.8, tone(FRAME))]
    m = SpeechMetrics.from_events(0.0, events, SR)
    margins = [3 * FRAME / SR - 0.2, 4 * FRAME / SR - 0.3]  # 56 ms, 41 ms
    assert m.viable and m.worst_margin_s == pytest.approx(min(margins))
    assert m.chunk_intervals_s == pytest.approx([0.2, 0.1])
    late = SpeechMetrics.from_events(0.0, events[:2] + [(0.95, tone(FRAME))], SR)
    assert not late.viable and late.worst_margin_s == pytest.approx(4 * FRAME / SR - 0.45)


def test_silence_and_empty_chunks():
    events = [(0.1, np.zeros(0, np.float32)),  # a window that completed no frame
              (0.2, np.full(FRAME, 5e-5, np.float32)),  # below the threshold: silent
              (0.3, np.zeros(0, np.float32)),
              (0.4, tone(FRAME)),
              (0.9, np.zeros(0, np.float32))]  # a trailing empty flush changes nothing
    m = SpeechMetrics.from_events(0.0, events, SR)
    assert m.ttfa_s == pytest.approx(0.4)  # the first audible sample, not the first chunk
    assert m.chunk_intervals_s == pytest.approx([0.2])  # empty chunks carry no audio
    assert m.audio_s == pytest.approx(2 * FRAME / SR)
    assert m.rtf == pytest.approx(0.4 / (2 * FRAME / SR))
    assert m.worst_margin_s == pytest.approx(0.2 + FRAME / SR - 0.4)
    loud = SpeechMetrics.from_events(0.0, events, SR, threshold=1e-5)
    assert loud.ttfa_s == pytest.approx(0.2)


def test_no_audio_and_sample_counts():
    m = SpeechMetrics.from_events(0.0, [(0.1, np.zeros(0))], SR)
    assert m.ttfa_s is None and m.audio_s == 0 and math.isinf(m.rtf)
    assert m.chunk_intervals_s == [] and math.isinf(m.worst_margin_s)
    counted = SpeechMetrics.from_events(0.0, [(0.1, 2400), (0.15, 2400)], SR)  # counts: audible
    assert counted.ttfa_s == pytest.approx(0.1) and counted.audio_s == pytest.approx(0.2)
    assert counted.worst_margin_s == pytest.approx(0.05)


def test_meter_timestamps_chunks_as_they_arrive():
    meter = SpeechMeter(SR)
    with pytest.raises(RuntimeError, match="start"):
        meter.add(tone(10))
    meter.start()
    time.sleep(0.02)
    meter.add(np.zeros(FRAME, np.float32))
    meter.add(tone(FRAME))
    time.sleep(0.01)
    meter.add(tone(FRAME))
    m = meter.finish()
    assert m.ttfa_s >= 0.02 and m.audio_s == pytest.approx(3 * FRAME / SR)
    assert len(m.chunk_intervals_s) == 2 and m.chunk_intervals_s[1] >= 0.01
    assert m.viable  # all arrived within 30 ms; 85 ms per frame
    assert "viable" in m.summary() and "TTFA" in m.summary()
