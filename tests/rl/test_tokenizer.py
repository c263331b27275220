import pytest

from minite.rl.tokenizer import CHAR_VOCAB, CharTokenizer, HFTokenizer, load_tokenizer


def test_char_round_trip():
    tok = CharTokenizer()
    text = "12+7*3=?\n7*3=21\n#### 33. The Answer is (1 + 2) / 3, <answer>x</answer>!"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert set(CHAR_VOCAB) <= set(tok.decode(range(tok.vocab_size)))


def test_char_specials_and_stable_ids():
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == 4 + len(CHAR_VOCAB) == len(set(CHAR_VOCAB)) + 4
    ids = tok.encode("3+4=7", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert ids[1:-1] == [7, 14, 8, 18, 11]  # fixed vocabulary: checkpoints stay valid
    assert tok.decode(ids) == "3+4=7"
    assert tok.decode(ids, skip_special=False) == "<bos>3+4=7<eos>"


def test_char_unknown_characters():
    with pytest.raises(ValueError, match="'é' at position 2"):
        CharTokenizer().encode("caé")
    tok = CharTokenizer(unknown="replace")
    assert tok.encode("aé") == [tok.encode("a")[0], tok.unk_token_id]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="unknown must be"):
        CharTokenizer(unknown="ignore")


def test_load_tokenizer_char():
    assert isinstance(load_tokenizer("char"), CharTokenizer)


def _save_tiny_hf_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "the", "answer", "is", "1", "2", "3", "+", "="]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(path)
    return words


def test_hf_tokenizer_wrapper(tmp_path):
    words = _save_tiny_hf_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(words)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.pad_token_id == tok.eos_token_id  # no pad token: falls back to eos
    ids = tok.encode("the answer is 3", add_bos=True, add_eos=True)
    assert ids == [1, 4, 5, 6, 9, 2]
    assert tok.decode(ids) == "the answer is 3"


def test_hf_tokenizer_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        HFTokenizer(str(tmp_path / "nope"))


def test_char_tokenizer_in_hugging_face_form(tmp_path):
    from transformers import AutoTokenizer

    tok = CharTokenizer()
    tok.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = "12+7*3=?\n#### 33. (1 + 2) / 3, <answer>x</answer>!"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(text, add_bos=True, add_eos=True), skip_special_tokens=True) == text
    assert len(hf) == tok.vocab_size and (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert HFTokenizer(str(tmp_path)).encode(text) == tok.encode(text)


def test_a_folder_without_tokenizer_files_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(str(tmp_path))
