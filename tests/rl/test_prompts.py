"""Prompts through a model's chat template, generation_config stop ids, stop strings."""

import json

import torch

from minite.rl.prompts import PromptFormat, cut_at_stop_strings, generation_config_stop_ids, stop_token_ids
from minite.rl.tokenizer import CharTokenizer, HFTokenizer
from minite.sampler.sequence import SampleOutput
from tests.rl.hf_model_dir import build_tokenizer


def hf_tokenizer(tmp_path):
    build_tokenizer(["What is 3 + 4? 3 + 4 = 7. #### 7"]).save_pretrained(tmp_path)
    return HFTokenizer(str(tmp_path))


def test_chat_template_system_prompt_and_kwargs(tmp_path):
    tok = hf_tokenizer(tmp_path)
    text = tok.tokenizer.decode(PromptFormat().encode(tok, "What is 3 + 4?"))
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    fmt = PromptFormat(system_prompt="Be brief.", template_kwargs={"enable_thinking": False})
    text = tok.tokenizer.decode(fmt.encode(tok, "Hi"))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.tokenizer.decode(PromptFormat(chat_template=False).encode(tok, "Hi")) == "Hi"


def test_without_a_template_the_text_as_it_is():
    tok = CharTokenizer()
    assert PromptFormat().encode(tok, "1+2=") == tok.encode("1+2=", add_bos=True)
    assert PromptFormat(system_prompt="Add.").encode(tok, "1+2=") == tok.encode("Add.\n\n1+2=", add_bos=True)


def test_stop_ids_from_generation_config(tmp_path):
    assert generation_config_stop_ids(tmp_path) == []
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert stop_token_ids(CharTokenizer(), tmp_path) == (2, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(CharTokenizer(), tmp_path) == (2, 9)


def test_a_stop_string_cuts_the_response_after_it():
    tok = CharTokenizer()
    ids = tok.encode("12 ## 34")
    sample = SampleOutput(ids, torch.arange(len(ids), dtype=torch.float32), "length")
    cut = cut_at_stop_strings(sample, tok, ["##", "zz"])
    assert tok.decode(cut.token_ids) == "12 ##" and cut.finish_reason == "stop"
    assert cut.logprobs.tolist() == [0, 1, 2, 3, 4]
    assert cut_at_stop_strings(sample, tok, ["zz"]) is sample
