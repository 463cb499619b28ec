"""Qwen3-Omni's chat format: OpenAI-style messages -> the prompt ids and audio features the
model's request takes, and the model's text tokens -> text deltas.

The format is ChatML, as Qwen3-Omni's chat template writes it::

    <|im_start|>system\\n{text}<|im_end|>\\n
    <|im_start|>user\\n<|audio_start|><|audio_pad|> * n<|audio_end|>{text}<|im_end|>\\n
    <|im_start|>assistant\\n

A message's audio goes before its text (``audio_first=False`` keeps the parts in order); each
audio becomes the log-mel features ``[128, frames]`` of Whisper's feature extractor at 16 kHz
(what Qwen3OmniMoeProcessor computes) and ``n`` placeholders, n the audio encoder's output
length for that many frames. Roles are single tokens (``system``, ``user``, ``assistant`` are
one token each in Qwen's vocabulary; the thinker and talker find turns by them).

    chat = OmniChat.of(model)
    prompt, features = chat.prompt([{"role": "user", "content": "Hi!"}])
    rt.submit({"prompt": prompt, "audio_features": features, ...})
"""

from __future__ import annotations

import base64
import binascii
import threading
from dataclasses import dataclass
from typing import Any, Callable, Container, Mapping, Optional, Sequence, Union

import numpy as np

#: The rate the audio encoder's features are computed at.
FEATURE_RATE = 16000
N_MELS = 128
HOP = 160  # samples per mel frame at 16 kHz: 100 frames a second
#: Raw ``pcm16`` input audio: 16-bit little-endian mono at OpenAI's PCM rate.
PCM16_RATE = 24000
INPUT_AUDIO_FORMATS = ("wav", "pcm16")
#: Longest input audio accepted, per clip (Qwen3-Omni reads up to 40 minutes).
MAX_INPUT_AUDIO_S = 40 * 60
ROLES = ("system", "user", "assistant")


class ChatError(ValueError):
    """A message cannot be put in the chat format; ``param`` names the field (for example
    ``messages[0].content[1].input_audio.format``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# ---- the model's token ids ---------------------------------------------------------------------

@dataclass(frozen=True)
class ChatTokens:
    """The ids the chat format writes: ChatML's turn markers, the role words, the audio
    placeholders, and the ids of ``"\\n"``."""

    im_start: int
    im_end: int
    system: int
    user: int
    assistant: int
    audio: int  # <|audio_pad|>, repeated once per encoder output frame
    audio_start: int
    audio_end: int
    newline_ids: tuple[int, ...]

    def role(self, name: str) -> int:
        return {"system": self.system, "user": self.user, "assistant": self.assistant}[name]

    @property
    def reserved(self) -> frozenset[int]:
        """Ids a message's text must not contain: they would forge turns or audio slots."""
        return frozenset((self.im_start, self.im_end, self.audio, self.audio_start,
                          self.audio_end))

    @staticmethod
    def of(source: Any) -> "ChatTokens":
        """From a ChatTokens, a mapping or an object with these names (``audio_pad`` for
        ``audio``, ``newline`` (an id or ids) for ``newline_ids`` are accepted too)."""
        if isinstance(source, ChatTokens):
            return source

        def get(*names: str) -> Any:
            for n in names:
                v = source.get(n) if isinstance(source, Mapping) else getattr(source, n, None)
                if v is not None:
                    return v
            raise ValueError(f"the model's tokens have no {names[0]!r} (ChatTokens needs "
                             "im_start, im_end, system, user, assistant, audio, audio_start, "
                             "audio_end, newline_ids)")

        nl = get("newline_ids", "newline")
        ids = {name: int(get(name, *aliases)) for name, *aliases in (
            ("im_start",), ("im_end",), ("system",), ("user",), ("assistant",),
            ("audio", "audio_pad", "audio_token"), ("audio_start",), ("audio_end",))}
        return ChatTokens(**ids, newline_ids=(int(nl),) if isinstance(nl, (int, np.integer))
                          else tuple(map(int, nl)))

    @staticmethod
    def from_tokenizer(tokenizer: Any) -> "ChatTokens":
        """From a ``tokenizers.Tokenizer`` (a checkpoint's ``tokenizer.json``) holding Qwen's
        special tokens and the role words as single tokens."""
        def one(token: str) -> int:
            i = tokenizer.token_to_id(token)
            if i is None:
                ids = _ids(tokenizer.encode(token))
                if len(ids) != 1:
                    raise ValueError(f"the tokenizer has no single token for {token!r} "
                                     f"(it encodes to {ids})")
                i = ids[0]
            return int(i)

        return ChatTokens(
            im_start=one("<|im_start|>"), im_end=one("<|im_end|>"), system=one("system"),
            user=one("user"), assistant=one("assistant"), audio=one("<|audio_pad|>"),
            audio_start=one("<|audio_start|>"), audio_end=one("<|audio_end|>"),
            newline_ids=tuple(_ids(tokenizer.encode("\n"))))


def audio_output_length(frames: int, n_window: int = 50) -> int:
    """How many audio placeholders ``frames`` mel frames become: the Qwen3-Omni audio encoder's
    output length (chunks of ``2 * n_window`` frames give 13 each; the rest goes through three
    stride-2 convolutions)."""
    chunk = 2 * n_window
    rest = frames % chunk
    length = (rest - 1) // 2 + 1
    return ((length - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13


# ---- messages ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class InputAudio:
    data: str  # base64, decoded (on a worker thread) when the prompt is made
    format: str
    where: str  # the part's place in the body, for errors


@dataclass(frozen=True)
class Message:
    """One message: its role (``developer`` is read as ``system``), its parts (text as str,
    audio as :class:`InputAudio`), and for an assistant turn given only by a previous answer's
    audio, that audio's ``id`` (the caller puts the transcript in ``parts``)."""

    role: str
    parts: tuple[Union[str, InputAudio], ...]
    audio_id: Optional[str] = None

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))


def parse_messages(messages: Any) -> list[Message]:
    """OpenAI chat ``messages`` -> :class:`Message` list; ChatError naming the first wrong
    field. Text and ``input_audio`` parts for users, text for the others; fields that are
    null or only describe an answer (``name``, ``refusal``, ``annotations``) are ignored."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages", "must be a non-empty list of {role, content} objects")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: Any, where: str) -> Message:
    if not isinstance(m, Mapping):
        raise ChatError(where, f"must be an object with 'role' and 'content', not "
                        f"{type(m).__name__}")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ROLES:
        hint = ("; tools are not served" if role in ("tool", "function") else "")
        raise ChatError(f"{where}.role", f"{role!r} is not a role served here; use 'system', "
                        f"'developer', 'user' or 'assistant'{hint}")
    for key in ("tool_calls", "function_call"):
        if m.get(key):
            raise ChatError(f"{where}.{key}", "tool calls are not served")
    content = m.get("content")
    audio_id = None
    if role == "assistant" and m.get("audio") is not None:
        audio = m["audio"]
        if not isinstance(audio, Mapping) or not isinstance(audio.get("id"), str):
            raise ChatError(f"{where}.audio", "must be {\"id\": \"<the id of an earlier "
                            "answer's audio>\"}")
        audio_id = audio["id"]
        transcript = audio.get("transcript")
        if transcript is not None and not isinstance(transcript, str):
            raise ChatError(f"{where}.audio.transcript", "must be a string")
        if not content and transcript is not None:
            content = transcript  # the SDK sends back the whole answer: its transcript is it
    if content is None:
        if audio_id is not None:
            return Message(role, (), audio_id)
        raise ChatError(f"{where}.content", "is missing; give a string or a list of parts")
    if isinstance(content, str):
        return Message(role, (_checked(content, f"{where}.content"),), audio_id)
    if not isinstance(content, list):
        raise ChatError(f"{where}.content", f"must be a string or a list of parts, not "
                        f"{type(content).__name__}")
    return Message(role, tuple(_part(p, role, f"{where}.content[{j}]")
                               for j, p in enumerate(content)), audio_id)


def _part(p: Any, role: str, where: str) -> Union[str, InputAudio]:
    kind = p.get("type") if isinstance(p, Mapping) else None
    if kind in ("text", "refusal") and (kind == "text" or role == "assistant"):
        text = p.get(kind)
        if not isinstance(text, str):
            raise ChatError(f"{where}.{kind}", "must be a string")
        return _checked(text, f"{where}.{kind}")
    if kind == "input_audio" and role == "user":
        audio = p.get("input_audio")
        if not isinstance(audio, Mapping):
            raise ChatError(f"{where}.input_audio", "must be {\"data\": \"<base64>\", "
                            "\"format\": \"wav\"}")
        fmt = audio.get("format")
        if fmt not in INPUT_AUDIO_FORMATS:
            mp3 = " (no MP3 decoder here)" if fmt == "mp3" else ""
            raise ChatError(f"{where}.input_audio.format", f"{fmt!r} is not read{mp3}; send "
                            "'wav' or 'pcm16' (16-bit little-endian mono at 24 kHz)")
        if not isinstance(audio.get("data"), str) or not audio["data"]:
            raise ChatError(f"{where}.input_audio.data", "must be the base64 of the audio")
        return InputAudio(audio["data"], fmt, f"{where}.input_audio")
    served = "'text' and 'input_audio'" if role == "user" else "'text'"
    if not isinstance(p, Mapping):
        raise ChatError(where, f"must be an object with a 'type' ({served})")
    raise ChatError(f"{where}.type", f"{kind!r} parts are not served in a {role} message; "
                    f"send {served}")


def _checked(text: str, where: str) -> str:
    """``text`` if it is valid Unicode (JSON can carry a lone surrogate, which no tokenizer
    takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ChatError(where, f"holds a lone surrogate ({text[e.start]!r} at {e.start}), "
                        "which is not text") from None
    return text


# ---- audio -------------------------------------------------------------------------------------

def decode_audio(audio: InputAudio) -> tuple[np.ndarray, int]:
    """An input audio part's samples (float32 mono) and rate; ChatError if unreadable."""
    from mstar_rt.audio.wav import WavError, read_wav

    try:
        raw = base64.b64decode(audio.data, validate=True)
    except (binascii.Error, ValueError):
        raise ChatError(f"{audio.where}.data", "is not valid base64") from None
    if audio.format == "pcm16":
        if len(raw) % 2:
            raise ChatError(f"{audio.where}.data", f"pcm16 audio has an odd byte count "
                            f"({len(raw)}); send whole 16-bit samples")
        pcm, rate = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0, PCM16_RATE
    else:
        try:
            pcm, rate = read_wav(raw)
        except WavError as e:
            raise ChatError(f"{audio.where}.data", f"{e}") from None
    seconds = len(pcm) / rate
    if len(pcm) * FEATURE_RATE < HOP * rate:
        raise ChatError(f"{audio.where}.data", f"holds {seconds * 1e3:.1f} ms of audio; send at "
                        "least 10 ms")
    if seconds > MAX_INPUT_AUDIO_S:
        raise ChatError(f"{audio.where}.data", f"holds {seconds:.0f} s of audio; the most "
                        f"read is {MAX_INPUT_AUDIO_S} s")
    return pcm, rate


_extractor: Any = None
_extractor_lock = threading.Lock()


def mel_features(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """Float samples at ``sample_rate`` -> the audio encoder's input ``[128, frames]`` float32:
    resampled to 16 kHz, then Whisper's log-mel features (128 bins, 10 ms hop, not padded),
    as Qwen3OmniMoeProcessor computes them (frames = samples at 16 kHz // 160)."""
    global _extractor
    from mstar_rt.audio.resample import Resampler

    x = np.asarray(pcm, np.float32).reshape(-1)
    if sample_rate != FEATURE_RATE:
        x = Resampler(sample_rate, FEATURE_RATE).process(x, last=True)
    with _extractor_lock:
        if _extractor is None:
            from transformers import WhisperFeatureExtractor

            _extractor = WhisperFeatureExtractor(feature_size=N_MELS)
    out = _extractor(x, sampling_rate=FEATURE_RATE, padding=True, truncation=False,
                     return_attention_mask=True, return_tensors="np")
    frames = int(out["attention_mask"][0].sum())
    return np.ascontiguousarray(out["input_features"][0, :, :frames], np.float32)


# ---- the prompt --------------------------------------------------------------------------------

def format_chat(messages: Sequence[Any], tokens: ChatTokens, encode: Callable[[str], Sequence[int]],
                audio_tokens: Callable[[int], int], audio_first: bool = True
                ) -> tuple[list[int], list[np.ndarray]]:
    """``messages`` (OpenAI dicts or :class:`Message`) -> (prompt ids ending with the
    assistant header, the audio features ``[128, frames]`` in prompt order). ``encode``: text ->
    ids (no special tokens added); ``audio_tokens``: mel frames -> placeholders. ChatError
    names the part at fault (unreadable audio, text holding a reserved token)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Message)
                                                          for m in messages):
        messages = parse_messages(list(messages) if isinstance(messages, tuple) else messages)
    ids: list[int] = []
    features: list[np.ndarray] = []
    for i, m in enumerate(messages):
        ids += [tokens.im_start, tokens.role(m.role)]
        audio = [p for p in m.parts if isinstance(p, InputAudio)]
        parts: Sequence[Union[str, InputAudio]] = (
            [*audio, m.text] if audio_first else _merge_text(m.parts))
        head = True  # the newline after the role is encoded with the text that follows it
        for p in parts:
            if isinstance(p, InputAudio):
                if head:
                    ids += tokens.newline_ids
                mel = mel_features(*decode_audio(p))
                features.append(mel)
                ids += [tokens.audio_start, *[tokens.audio] * audio_tokens(mel.shape[1]),
                        tokens.audio_end]
            else:
                ids += _text_ids(("\n" if head else "") + p, tokens, encode, i)
            head = False
        if head:
            ids += tokens.newline_ids
        ids += [tokens.im_end, *tokens.newline_ids]
    ids += [tokens.im_start, tokens.assistant, *tokens.newline_ids]
    return ids, features


def _merge_text(parts: Sequence[Union[str, InputAudio]]) -> list[Union[str, InputAudio]]:
    out: list[Union[str, InputAudio]] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


def _text_ids(text: str, tokens: ChatTokens, encode: Callable[[str], Sequence[int]],
              i: int) -> list[int]:
    ids = [int(t) for t in _ids(encode(text))] if text else []
    bad = tokens.reserved.intersection(ids)
    if bad:
        raise ChatError(f"messages[{i}].content", f"the text holds chat control tokens (ids "
                        f"{sorted(bad)}: turn markers or audio slots); remove them")
    return ids


def _ids(encoded: Any) -> list[int]:
    """A tokenizer's encode() result as ids (``tokenizers`` returns an Encoding)."""
    return list(getattr(encoded, "ids", encoded))


# ---- text out ----------------------------------------------------------------------------------

class TextDeltas:
    """Generated token ids -> the text they add, as they come. A character split over tokens
    (byte-level BPE) is held back until complete; ``skip`` ids (turn markers) add nothing."""

    def __init__(self, decode: Callable[[Sequence[int]], str], skip: Container[int] = ()) -> None:
        self.decode, self.skip = decode, skip
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # ids[prefix:read] decode to the text sent last

    def push(self, token: int) -> str:
        if token in self.skip:
            return ""
        self.ids.append(int(token))
        return self._advance(final=False)

    def flush(self) -> str:
        """What is still held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        after = self.decode(self.ids[self._prefix:]) if len(self.ids) > self._prefix else ""
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


# ---- the model's side --------------------------------------------------------------------------

#: The system prompt of ``/v1/audio/speech`` on an omni model.
SPEAK_PROMPT = "Read the user's message aloud exactly as it is written. Add nothing."


@dataclass(frozen=True)
class OmniChat:
    """What a chat front-end needs of a speech-in, speech-out model: its chat ids, text
    encode/decode, placeholders per audio, voices and output rate. :meth:`of` reads it off a
    model that follows the contract (request inputs ``prompt`` and ``audio_features``;
    attributes ``tokens``, ``tokenizer``, ``speakers``, ``sample_rate``,
    ``audio_output_length``)."""

    tokens: ChatTokens
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    audio_tokens: Callable[[int], int]
    speakers: tuple[str, ...]
    sample_rate: int

    @staticmethod
    def of(model: Any) -> Optional["OmniChat"]:
        """The chat view of ``model``, or None if it does not follow the contract (or has no
        tokenizer). Without ``tokens`` the ids come from the tokenizer
        (:meth:`ChatTokens.from_tokenizer`)."""
        inputs = set(getattr(model, "inputs", ()) or ())
        needed = ("speakers", "sample_rate", "audio_output_length")
        tok = getattr(model, "tokenizer", None)
        if (not {"prompt", "audio_features"} <= inputs or tok is None
                or not all(hasattr(model, a) for a in needed)):
            return None
        tokens = getattr(model, "tokens", None)
        return OmniChat(tokens=ChatTokens.of(tokens) if tokens is not None
                        else ChatTokens.from_tokenizer(tok),
                        encode=lambda text: [int(i) for i in _ids(tok.encode(text))],
                        decode=lambda ids: tok.decode(list(ids)),
                        audio_tokens=lambda frames: int(model.audio_output_length(int(frames))),
                        speakers=tuple(model.speakers), sample_rate=int(model.sample_rate))

    def prompt(self, messages: Sequence[Any]) -> tuple[list[int], list[np.ndarray]]:
        return format_chat(messages, self.tokens, self.encode, self.audio_tokens)

    def speaker(self, voice: Optional[str]) -> Optional[str]:
        """The speaker named ``voice`` (case aside); None for None; ValueError if unknown."""
        if voice is None:
            return None
        for s in self.speakers:
            if s == voice or s.lower() == voice.lower():
                return s
        raise ValueError(f"unknown voice {voice!r}; this model speaks {list(self.speakers)}")

    def text_deltas(self) -> TextDeltas:
        return TextDeltas(self.decode, self.tokens.reserved)
