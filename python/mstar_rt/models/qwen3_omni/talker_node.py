"""The talker's nodes: the talker LM on its own KV engine, and the code predictor's inner loop.

Each iteration of the ``talk`` loop is one codec frame: the ``talker`` node makes code group 0
(prefill on the first iteration, from the thinker's ``prompt_states`` and first reply token;
then one step per frame, fed the last frame's summed code embeddings plus the next reply
token's projected embedding -- ``tts_eos`` once the thinker's reply is over, ``tts_pad`` after),
and a ``Loop`` of ``G - 1`` ``code_predictor`` steps (batched across requests) makes the other
groups. The talker streams each finished frame's ``G`` codes to code2wav.

The talker reads the thinker through two streams in a loop the thinker is not in: each
iteration takes the next window of each (``Fixed(1)``) and ``continue_after_done`` lets it go
on speaking after the thinker has finished, exactly the way transformers' talker pads its text
input. Sequences equal transformers' ``generate`` token for token (tests/python/test_omni.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from mstar_rt.engines.kv_engine import KVNodeSubmodule, KVStep, KVWork
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.engines.sampling import SamplingParams, make_generator, sample
from mstar_rt.model import NodeSubmodule, StreamChunk, WorkContext
from mstar_rt.models.causal_lm import as_params
from mstar_rt.models.qwen3_omni.checkpoint import Qwen3OmniConfig
from mstar_rt.models.qwen3_omni.code_predictor import PREDICTOR_SAMPLING, CodePredictor, PredictorState
from mstar_rt.models.qwen3_omni.talker import TalkerLM

TALK = "talk"  # the talker's DynamicLoop
#: transformers' talker defaults (Qwen3OmniMoeForConditionalGeneration.generate)
TALKER_SAMPLING = SamplingParams(max_tokens=4096, temperature=0.9, top_k=50, top_p=1.0,
                                 repetition_penalty=1.05)


class TalkerNode(KVNodeSubmodule):
    """Inputs: the streams ``prompt_states`` and ``reply``, the last ``frame`` (None at first),
    ``speaker``, ``talker_sampling``, ``max_audio_frames``. Outputs ``talk_out`` (for the code
    predictor) and ``frame_codes`` (the previous frame, streamed to code2wav)."""

    def __init__(self, module: TalkerLM, thinker_embed: torch.nn.Embedding,
                 config: Qwen3OmniConfig, max_seq_len: int, max_batch: int = 32) -> None:
        self.module = module.eval()
        self.config, self.max_seq_len, self.max_batch = config, max_seq_len, max_batch
        c = config
        vocab = int(module.config.vocab_size)
        self.eos = c.codec["codec_eos_token_id"]
        # generate() suppresses the codec specials (the top 1024 ids) but the end of speech
        self.suppress = torch.zeros(vocab, dtype=torch.bool)
        self.suppress[max(vocab - 1024, 0):] = True
        self.suppress[self.eos] = False
        dev = module.model.codec_embedding.weight.device
        with torch.inference_mode():
            ids = torch.tensor([c.tts_bos, c.tts_eos, c.tts_pad], device=dev)
            self.tts_bos, self.tts_eos, self.tts_pad = module.text_projection(
                thinker_embed(ids).to(module.model.codec_embedding.weight.dtype)).unbind(0)
        self.specials = [c.codec["codec_nothink_id"], c.codec["codec_think_bos_id"],
                         c.codec["codec_think_eos_id"], None, c.codec["codec_pad_id"],
                         c.codec["codec_bos_id"]]

    def kv_layout(self) -> KVLayout:
        return self.module.kv_layout()

    def _dtype(self) -> torch.dtype:
        return self.module.model.codec_embedding.weight.dtype

    def speaker_id(self, speaker: Optional[str]) -> int:
        voices = self.config.speaker_id
        if speaker is None:  # transformers' default voice, else the first one listed
            return voices.get("ethan", next(iter(voices.values())))
        if speaker.lower() not in voices:
            raise ValueError(f"unknown speaker {speaker!r}; this model speaks as "
                             f"{sorted(voices)}")
        return voices[speaker.lower()]

    def prefill_rows(self, states: Mapping[str, Any], first: torch.Tensor,
                     speaker: int) -> torch.Tensor:
        """The talker's prompt: the user turns' rows (audio positions from the thinker's hidden
        states, text from its embeddings, both projected) and the assistant's 9 opening rows."""
        c, m = self.config, self.module
        ids, emb, hid = states["ids"], states["embeds"], states["hidden"]
        dev, dt = self.tts_pad.device, self._dtype()
        # a token's role is the one after the <|im_start|> before it
        starts = torch.where(ids == c.im_start, torch.arange(len(ids)), -1).cummax(0).values
        role = ids[(starts.clamp_min(0) + 1).clamp_max(len(ids) - 1)]
        user = (role == c.user) & (starts >= 0)
        media = ids == c.audio
        rows = torch.empty(int(user.sum()), self.tts_pad.shape[0], dtype=dt, device=dev)
        u_media = media[user]
        if u_media.any():
            rows[u_media] = m.hidden_projection(hid[user & media].to(dev, dt))
        if (~u_media).any():
            rows[~u_media] = m.text_projection(emb[user & ~media].to(dev, dt))
        opening = torch.nonzero((ids[:-1] == c.im_start) & (ids[1:] == c.assistant))
        if len(opening) == 0:
            raise ValueError("the prompt does not end with an assistant turn "
                             "(<|im_start|>assistant\\n); format it with format_chat")
        a = int(opening[-1])
        text = m.text_projection(torch.cat([emb[a:a + 3].to(dev, dt), first[None].to(dev, dt)]))
        codec = torch.tensor([x if x is not None else speaker for x in self.specials], device=dev)
        opening_rows = torch.cat([text[:3], self.tts_pad.expand(4, -1), self.tts_bos[None],
                                  text[3:4]])
        codec_rows = torch.cat([torch.zeros(3, rows.shape[1], dtype=dt, device=dev),
                                m.embed(codec)])
        return torch.cat([rows, opening_rows + codec_rows])

    @torch.inference_mode()
    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        state = ctx.request.state
        prompt: StreamChunk = inputs["prompt_states"]
        reply: StreamChunk = inputs["reply"]
        frame = inputs.get("frame")
        dev = self.tts_pad.device
        if "talker_frames" not in state:  # the first iteration: prefill
            if not reply.items:  # the thinker said nothing (its first token ended the reply)
                state.update(talker_frames=0, talker_stop=True, talker_max=0)
                return KVWork(1, persist=False, payload=("skip", None, state, None),
                              must_exist=False)  # nothing to attend over: on purpose
            params = as_params(inputs.get("talker_sampling") or TALKER_SAMPLING)
            max_frames = int(inputs.get("max_audio_frames") or params.max_tokens)
            state.update(talker_params=params, talker_gen=make_generator(params, dev),
                         talker_history=[], talker_frames=0, talker_max=max_frames,
                         talker_eos_sent=False, talker_stop=False,
                         predictor_sampling=inputs.get("code_predictor_sampling"))
            rows = self.prefill_rows(prompt.items[0], reply.items[0],
                                     self.speaker_id(inputs.get("speaker")))
            reserve = min(rows.shape[0] + max_frames + 1, self.max_seq_len)
            return KVWork(rows.shape[0], reserve=reserve, payload=("prefill", rows, state, None),
                          reserve_for=f"a talker prompt of {rows.shape[0]} rows + "
                                      f"max_audio_frames {max_frames}",
                          reserve_fix="lower max_audio_frames or shorten the prompt")
        if reply.items:
            text = self.module.text_projection(reply.items[0].to(dev, self._dtype()))
        elif not state["talker_eos_sent"]:
            text, state["talker_eos_sent"] = self.tts_eos, True
        else:
            text = self.tts_pad
        codes, frame_embed = frame
        return KVWork(1, payload=("decode", (frame_embed.to(dev) + text)[None], state, codes),
                      must_exist=True)

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        hidden = self.module(torch.cat([w.payload[1] if w.payload[0] != "skip" else
                                        self.tts_pad[None] for w in works]), step)
        last = hidden[step.last_token]
        logits = self.module.logits(last).float()
        logits[:, self.suppress.to(logits.device)] = float("-inf")
        live = [i for i, w in enumerate(works) if w.payload[0] != "skip"]
        states = [works[i].payload[2] for i in live]
        params = [s["talker_params"] for s in states]
        for i, p in zip(live, params):
            if p.ignore_eos:  # a fixed length (benchmarks): speak until max_audio_frames
                logits[i, self.eos] = float("-inf")
        histories = [torch.tensor(s["talker_history"], dtype=torch.long) for s in states]
        codes0 = sample(logits[live], params, [s["talker_gen"] for s in states],
                        histories).tolist() if live else []
        out: list[Mapping[str, Any]] = [{"talk_out": None} for _ in works]
        for j, i in enumerate(live):
            s, code0 = states[j], codes0[j]
            s["talker_history"].append(code0)
            s["talker_frames"] += 1
            s["talker_stop"] = (code0 == self.eos or s["talker_frames"] >= s["talker_max"])
            o: dict[str, Any] = {}
            if works[i].payload[3] is not None:  # the frame the last iteration finished
                o["frame_codes"] = works[i].payload[3]
            # None on the last iteration: the predictor (which still runs its steps in this
            # iteration) must not read the last iteration's value again
            o["talk_out"] = None if s["talker_stop"] else (
                last[i], code0, self.module.embed(torch.tensor([code0], device=last.device))[0],
                s.get("predictor_sampling"))
            out[i] = o
        return out

    def check_stop(self, works: list[KVWork], outputs: list) -> list:
        return [(TALK,) if w.payload[2]["talker_stop"] else () for w in works]


class PredictorNode(NodeSubmodule):
    """Step ``j + 1`` of the code predictor per execution (the inner ``Loop``'s iteration
    ``j``), batched across requests at the same step; the last step outputs ``frame``: the
    ``G`` codes and their summed embedding, the talker's next input."""

    max_batch = 32

    def __init__(self, predictor: CodePredictor) -> None:
        self.predictor = predictor.eval()
        self.groups = predictor.groups

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> Any:
        return ctx.request.state, ctx.iteration, inputs.get("talk_out")

    @torch.inference_mode()
    def forward(self, batch: list[Any]) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = [{} for _ in batch]
        by_step: dict[int, list[int]] = {}
        for i, (_s, j, talk) in enumerate(batch):
            if talk is not None:
                by_step.setdefault(j, []).append(i)
        p = self.predictor
        for j, rows in by_step.items():
            if j == 0:
                talk = [batch[i][2] for i in rows]
                sampling = [_predictor_params(t[3], batch[i][0]) for t, i in zip(talk, rows)]
                state = p.start(torch.stack([t[0] for t in talk]),
                                torch.stack([t[2] for t in talk]), sampling)
            else:
                state = PredictorState.stack([batch[i][0]["predictor"] for i in rows])
            p.step(state, j + 1)
            parts = state.split()
            for i, part in zip(rows, parts):
                s, _, talk = batch[i]
                s["predictor"] = part
                if j + 2 == self.groups:  # the frame is complete
                    codes = part.codes[0]
                    embed = p.frame_embedding(talk[2][None], part.codes)[0]
                    full = torch.cat([torch.tensor([talk[1]]), codes.cpu()])
                    out[i] = {"frame": (full.numpy(), embed)}
                    del s["predictor"]
        return out


def _predictor_params(given: Any, state: dict) -> SamplingParams:
    """transformers samples the residual codes (top-k 50, top-p 0.8) when the talker samples,
    and picks them greedily when it does not; ``code_predictor_sampling`` overrides."""
    if given is not None:
        return as_params(given)
    return PREDICTOR_SAMPLING if not state["talker_params"].greedy else SamplingParams()
