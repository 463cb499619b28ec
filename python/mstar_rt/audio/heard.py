"""What the listener heard of a spoken reply, for a voice agent's conversation history.

A reply the user barges in on was mostly never played: the model made its text (and often its
audio) far ahead of the speaker. The history must hold what the user heard, as OpenAI's realtime
API truncates an interrupted item to the audio played, or the next turn answers as if the user
had heard it all.

The audio that reached the speaker is what the reply wrote to the output less what the barge-in
flush dropped from its queue (everything handed to the device plays out). An omni model maps
those samples to the text they can hold: Qwen3-Omni's talker reads one thinker token per codec
frame (:meth:`~mstar_rt.models.qwen3_omni.omni.Qwen3Omni.tokens_read_by`), so the played frames
give the tokens its audio had been made from, to whole tokens. A reply that ran to its end and
played without a barge-in is kept whole.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["heard_tokens", "played_samples"]


def played_samples(written_frames: int, flushed_frames: int, output: Any,
                   sample_rate: int) -> int:
    """Samples of a reply at ``sample_rate`` that reached the speaker: the device-rate frames
    it wrote to ``output`` less those a flush dropped, converted to ``sample_rate`` (the
    output's resampler aligns frame k with source time k / rate)."""
    frames = max(int(written_frames) - int(flushed_frames), 0)
    rate = int(getattr(output, "samplerate", sample_rate))
    return frames * sample_rate // rate


def heard_tokens(tokens: Sequence[int], played: int, whole: bool,
                 tokens_read_by: Optional[Callable[[int], int]]) -> list[int]:
    """The prefix of a reply's ``tokens`` (as made, specials included: the talker reads them
    by position) that its first ``played`` samples were made from. ``whole``: the reply ran to
    its end and played uncut, so all of it. Without ``tokens_read_by`` (a model that gives no
    alignment) a cut reply keeps nothing rather than text that may not have been said."""
    if whole:
        return list(tokens)
    if played <= 0 or tokens_read_by is None:
        return []
    return list(tokens[:max(0, min(len(tokens), int(tokens_read_by(played))))])
