"""A tiny Hugging Face Qwen3 directory built offline, as a practitioner's own model would come: a
byte-level BPE tokenizer trained with `tokenizers` on the task's text, a chat template, a
generation_config with a list of stop ids, and random weights saved by transformers.

The weights lean towards ending a response: every embedding carries a constant in dimension 0 and
the head row of <|im_end|> reads it, so a sampled response ends after a few tokens (p ~ 0.15 a token)
and the greedy one at once; runs stay short on a CPU whatever sampling.max_tokens is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def qa_rows(count: int, offset: int = 0) -> list[dict]:
    """GSM8K-style rows: "What is a + b?" with a worked answer ending in "#### sum"."""
    rows = []
    for i in range(offset, offset + count):
        a, b = 3 + i % 17, 5 + (7 * i) % 23
        rows.append({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}.\n#### {a + b}"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_tokenizer(texts: list[str], vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@torch.no_grad()
def build_model_dir(path: Path, texts: list[str], eos_lean: float = 0.5) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(texts)
    tok.save_pretrained(path)
    im_end, end_of_text = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=im_end, pad_token_id=end_of_text, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float()
    model.model.embed_tokens.weight[:, 0] = 4.0
    model.lm_head.weight[:, 0] = 0.0
    model.lm_head.weight[im_end, 0] = eos_lean
    model.save_pretrained(path)
    transformers.GenerationConfig(eos_token_id=[im_end, end_of_text], pad_token_id=end_of_text,
                                  do_sample=True, temperature=0.7, top_p=0.8).save_pretrained(path)
    return path
