"""How the sentence TTS models cut a reply: sentences, a long one in pieces that each fit one
synthesis call, and no piece dropped past the loop's cap."""

import numpy as np
import pytest

from mstar_rt.audio.tts import speech_pieces, split_sentences
from mstar_rt.runtime import Runtime
from mstar_rt.serve.speech_models import PIECE_CHARS, SentenceTTS, reply_pieces


def test_short_sentences_stay_whole_and_a_long_one_is_cut_after_commas_then_words():
    assert speech_pieces("Hi there. How are you?") == ["Hi there.", "How are you?"]
    text = "The arm moves, then it stops: and after a long pause, it moves again, fine."
    assert speech_pieces(text, 40) == ["The arm moves, then it stops:",
                                       "and after a long pause, it moves again,", "fine."]
    words = "one two three four five six seven eight nine ten"
    assert speech_pieces(words, 15) == ["one two three", "four five six", "seven eight",
                                        "nine ten"]
    assert speech_pieces("x" * 25 + " y.", 10) == ["x" * 10, "x" * 10, "x" * 5 + " y."]
    for text in ("word, " * 500, "a " * 3000 + ".", "Ab. " * 50 + "c" * 999):
        pieces = speech_pieces(text, 100)
        assert all(0 < len(p) <= 100 for p in pieces)
        assert "".join(pieces).replace(" ", "") == "".join(text.split())  # nothing lost


def test_more_pieces_than_the_loop_allows_are_spoken_together_not_dropped():
    text = " ".join(f"S{i}." for i in range(1000))
    pieces = reply_pieces(text, 256)
    assert len(pieces) <= 256 and " ".join(pieces) == " ".join(split_sentences(text))
    assert reply_pieces("", 4) == [""]


def test_a_sentence_tts_speaks_every_piece_and_refuses_text_past_its_cap():
    model = SentenceTTS("espeak", voices=["en-us"], max_sentences=4)
    text = "One. Two. Three. Four. Five. Six."  # six sentences, a loop of four: in pairs
    assert reply_pieces(text, 4) == ["One. Two.", "Three. Four.", "Five. Six."]
    with Runtime(model) as rt:
        chunks = rt.submit({"text": text, "voice": None}).result(timeout=60)["audio"]
        assert len(chunks) == 3 and all(len(c) > 0 for c in chunks)
        whole = np.concatenate(chunks)
        assert np.abs(whole).max() > 0.1
        with pytest.raises(ValueError, match=f"at most {4 * PIECE_CHARS}"):
            rt.submit({"text": "a" * (4 * PIECE_CHARS + 1), "voice": None})
