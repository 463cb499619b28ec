"""The thinker's nodes: the audio encoder (a stateless batch of mel spectrograms) and the
thinker LM on the KV engine, for prefill (the chat prompt, audio placeholders replaced by the
encoder's rows) and decode (one token per step).

What the talker needs from the thinker leaves through two streams, as in M*'s Qwen3-Omni graph:
``prompt_states`` (one item: the prompt's ids, input embeddings and the hidden states of layer
``accept_hidden_layer``) and ``reply`` (one item per decode step: the input embedding of the
token that step *fed*, i.e. every generated token but the last, which transformers' talker
never sees either -- its place is taken by ``tts_eos``)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from mstar_rt.engines.kv_engine import KVNodeSubmodule, KVStep, KVWork
from mstar_rt.engines.paged_kv import KVLayout
from mstar_rt.engines.sampling import make_generator, sample
from mstar_rt.model import NodeSubmodule, WorkContext
from mstar_rt.models.causal_lm import as_params
from mstar_rt.models.qwen3_omni.thinker import ThinkerLM

THINK = "think"  # the thinker's DynamicLoop

_EMPTY = torch.empty(0, dtype=torch.long)


class AudioEncoderNode(NodeSubmodule):
    """``audio_features`` (a list of ``[128, frames]`` mel arrays, maybe empty) -> ``audio_embeds``
    (a list of ``[N_i, thinker width]`` tensors), several requests' audios in one call."""

    max_batch = 8

    def __init__(self, encoder: Optional[torch.nn.Module]) -> None:
        self.encoder = encoder

    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> list[torch.Tensor]:
        feats = [torch.as_tensor(np.asarray(f, dtype=np.float32)) for f in
                 (inputs.get("audio_features") or [])]
        for i, f in enumerate(feats):
            if f.dim() != 2 or f.shape[0] != 128 or f.shape[1] < 1:
                raise ValueError(f"audio_features[{i}] has shape {tuple(f.shape)}; give log-mel "
                                 "features [128, frames] (mstar_rt.models.qwen3_omni.chat."
                                 "mel_features makes them from 16 kHz audio)")
        if feats and self.encoder is None:
            raise ValueError("this Qwen3-Omni has no audio encoder; send text only")
        return feats

    @torch.inference_mode()
    def forward(self, batch: list[list[torch.Tensor]]) -> list[Mapping[str, Any]]:
        flat = [f for feats in batch for f in feats]
        if not flat:
            return [{"audio_embeds": []} for _ in batch]
        p = next(self.encoder.parameters())
        out = self.encoder([f.to(p.device, p.dtype) for f in flat])
        result, i = [], 0
        for feats in batch:
            result.append({"audio_embeds": list(out[i:i + len(feats)])})
            i += len(feats)
        return result


class ThinkerNode(KVNodeSubmodule):
    """Prefill (inputs ``prompt``, ``audio_embeds``, ``thinker_sampling``, ``max_tokens``) and
    decode (input ``token``) of the thinker for many requests in one ragged batch; stops the
    ``think`` loop on ``im_end`` (or another EOS), ``max_tokens`` or the sequence limit."""

    def __init__(self, module: ThinkerLM, audio_token: int, eos: Sequence[int],
                 accept_hidden_layer: int, max_seq_len: int, max_batch: int = 32,
                 for_talker: bool = True) -> None:
        self.module = module.eval()
        self.for_talker = for_talker  # make prompt_states and reply (the speak walk) or not
        self.audio_token = audio_token
        self.eos = frozenset(eos)
        self.accept = accept_hidden_layer
        self.max_seq_len, self.max_batch = max_seq_len, max_batch
        self.vocab = int(module.config.vocab_size)

    def kv_layout(self) -> KVLayout:
        return self.module.kv_layout()

    def _device(self) -> torch.device:
        return self.module.model.embed_tokens.weight.device

    def prompt_ids(self, prompt: Any) -> torch.Tensor:
        """The prompt as a flat id tensor; ValueError when it is empty, too long for the
        thinker's sequence limit, or holds an id outside the vocabulary (checked at submit by
        the model's validate_inputs too, so a server answers 400)."""
        ids = torch.as_tensor(np.asarray(prompt), dtype=torch.long).reshape(-1)
        if ids.numel() == 0 or ids.numel() >= self.max_seq_len:
            raise ValueError(f"the prompt has {ids.numel()} tokens; give 1 .. "
                             f"{self.max_seq_len - 1} (the thinker's sequence limit)")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab})")
        return ids

    @torch.inference_mode()
    def prepare_inputs(self, ctx: WorkContext, inputs: dict) -> KVWork:
        state = ctx.request.state
        dev = self._device()
        if "prompt" not in inputs:  # decode: the token the last step made
            if state.get("thinker_done"):  # the prefill's token already ended the reply
                return KVWork(1, persist=False, payload=("skip", None, state),
                              must_exist=False)  # reads nothing: its K/V may be gone
            tok = torch.tensor([int(inputs["token"])], dtype=torch.long, device=dev)
            return KVWork(1, payload=("decode", tok, state), must_exist=True)
        ids = self.prompt_ids(inputs["prompt"])
        audio = list(inputs.get("audio_embeds") or [])
        slots = int((ids == self.audio_token).sum())
        rows = sum(int(a.shape[0]) for a in audio)
        if slots != rows:
            raise ValueError(f"the prompt has {slots} audio placeholders but its audio gives "
                             f"{rows} rows; put AudioEncoder.output_length(frames) placeholders "
                             "per audio (mstar_rt.models.qwen3_omni.chat.format_chat does)")
        params = as_params(inputs.get("thinker_sampling"))
        max_tokens = int(inputs.get("max_tokens") or params.max_tokens)
        state.update(thinker_params=params, thinker_gen=make_generator(params, dev),
                     thinker_history=ids.tolist(), thinker_made=0, thinker_max=max_tokens,
                     thinker_done=False)
        embeds = self.module.embed(ids.to(dev))
        if audio:
            embeds = embeds.clone()
            embeds[ids.to(dev) == self.audio_token] = torch.cat(audio).to(embeds)
        reserve = min(ids.numel() + max_tokens, self.max_seq_len)
        return KVWork(ids.numel(), reserve=reserve, payload=("prefill", (ids, embeds), state),
                      reserve_for=f"a thinker prompt of {ids.numel()} tokens + max_tokens "
                                  f"{max_tokens}",
                      reserve_fix="lower max_tokens or shorten the prompt")

    @torch.inference_mode()
    def forward_kv(self, works: list[KVWork], step: KVStep) -> list[Mapping[str, Any]]:
        rows = []
        for w in works:
            kind, x, _ = w.payload
            rows.append(x[1] if kind == "prefill" else
                        self.module.embed(x) if kind == "decode" else
                        self.module.embed(torch.zeros(1, dtype=torch.long, device=self._device())))
        embeds = torch.cat(rows)
        final, at_k = self.module(None, step, embeds=embeds,
                                  hidden_layer=self.accept if self.for_talker and any(
                                      w.payload[0] == "prefill" for w in works) else None)
        logits = self.module.logits(final[step.last_token])
        live = [i for i, w in enumerate(works) if w.payload[0] != "skip"]
        states = [works[i].payload[2] for i in live]
        params = [s["thinker_params"] for s in states]
        histories = [torch.tensor(s["thinker_history"]) if p.repetition_penalty != 1.0
                     else _EMPTY for s, p in zip(states, params)]
        tokens = sample(logits[live], params, [s["thinker_gen"] for s in states],
                        histories).tolist() if live else []
        out: list[Mapping[str, Any]] = [{} for _ in works]
        start = 0
        for i, w in enumerate(works):
            n = w.num_tokens
            if not self.for_talker:
                pass
            elif w.payload[0] == "prefill":
                ids, emb = w.payload[1]
                out[i] = {"prompt_states": {"ids": ids, "embeds": emb.float().cpu(),
                                            "hidden": at_k[start:start + n].float().cpu()}}
            elif w.payload[0] == "decode":
                out[i] = {"reply": embeds[start].float().cpu()}
            start += n
        for j, i in enumerate(live):
            s, tok = states[j], tokens[j]
            s["thinker_history"].append(tok)
            s["thinker_made"] += 1
            eos = tok in self.eos and not s["thinker_params"].ignore_eos
            s["thinker_done"] = (eos or s["thinker_made"] >= s["thinker_max"]
                                 or len(s["thinker_history"]) >= self.max_seq_len)
            out[i] = {**out[i], "token": tok}
        return out

    def check_stop(self, works: list[KVWork], outputs: list) -> list:
        return [(THINK,) if w.payload[2]["thinker_done"] else () for w in works]
