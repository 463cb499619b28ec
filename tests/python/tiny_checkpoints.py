"""Tiny Hugging Face checkpoint directories built on the fly (no weights can be downloaded):
a byte-level BPE tokenizer trained on a few sentences, a small Llama trained for a few hundred
steps to say one reply (so greedy decoding makes real sentences), and a random Whisper.

Each ``*_dir`` function writes ``config.json``, ``model.safetensors`` and the tokenizer files
that ``from_pretrained`` reads, and returns the transformers model it saved (the reference)."""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

CORPUS = ("open the gripper", "move the arm to the left", "pick up the cup", "hello",
          "Opening the gripper. The arm is ready. Anything else?",
          "I can move the arm, open the gripper and pick up the cup.")

#: A chat template in the style of real instruct models (role headers, end-of-turn token).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizer_dir(path: str | os.PathLike, corpus: Sequence[str] = CORPUS,
                  chat_template: Optional[str] = None, specials: Sequence[str] = (),
                  vocab_size: int = 360) -> "object":
    """Trains a byte-level BPE on ``corpus`` and saves it (tokenizer.json +
    tokenizer_config.json) as a PreTrainedTokenizerFast with bos ``<s>`` and eos ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>", *specials]
    if chat_template:
        special += ["<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = [*corpus, *(f"User: {c}\nAssistant: {c}\n" for c in corpus)]
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    if chat_template:
        fast.chat_template = chat_template
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def llama_dir(path: str | os.PathLike, tokenizer: "object", say: Sequence[tuple[str, str]] = (),
              steps: int = 300, seed: int = 0, **config: object) -> "object":
    """A small Llama over ``tokenizer``'s vocabulary, trained (Adam, ``steps`` steps) on the
    token sequences ``say`` (pairs of prompt text and reply text, joined) so that greedy decoding
    of the prompt continues with the reply; random when ``say`` is empty. Saved with eos = the
    tokenizer's."""
    import transformers

    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    fields.update(config)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    if say:
        seqs = [torch.tensor([p + r]) for p, r in
                ((list(prompt), tokenizer.encode(reply, add_special_tokens=False))
                 for prompt, reply in say)]
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        model.train()
        for step in range(steps):
            ids = seqs[step % len(seqs)]
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def whisper_dir(path: str | os.PathLike, seed: int = 0) -> tuple["object", "object"]:
    """A random 2-layer Whisper (80 mel bins, 3000 frames) with a byte-level BPE tokenizer that
    has Whisper's special tokens, a preprocessor_config.json and a generation config that
    transcribes English without timestamps. Returns (model, tokenizer)."""
    import transformers

    # As in Whisper's vocabulary the specials follow the text tokens, and every id above
    # <|notimestamps|> would be a timestamp: it comes last, so there are none.
    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                "<|translate|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    ids = {s: fast.convert_tokens_to_ids(s) for s in specials}
    torch.manual_seed(seed)
    config = transformers.WhisperConfig(
        vocab_size=len(fast), num_mel_bins=80, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, d_model=64,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500,
        max_target_positions=64, init_std=0.3, pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
        decoder_start_token_id=ids["<|startoftranscript|>"], begin_suppress_tokens=None,
        suppress_tokens=None)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    gen = model.generation_config
    gen.decoder_start_token_id = ids["<|startoftranscript|>"]
    gen.eos_token_id = gen.pad_token_id = ids["<|endoftext|>"]
    gen.forced_decoder_ids = None
    gen.no_timestamps_token_id = ids["<|notimestamps|>"]
    gen.lang_to_id = {"<|en|>": ids["<|en|>"]}
    gen.task_to_id = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    gen.is_multilingual = True
    gen.max_length = 64
    gen.begin_suppress_tokens = None
    gen.suppress_tokens = None
    gen._from_model_config = False  # else from_pretrained rebuilds it from config.json
    model.save_pretrained(path)
    fast.save_pretrained(path)
    transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(path)
    return model, fast
