"""Tokenizers behind one small interface: a built-in character tokenizer and a model directory's own.

Both expose `encode(text, add_bos=False, add_eos=False) -> list[int]`, `decode(ids, skip_special=True)
-> str`, `vocab_size`, `pad_token_id`, `bos_token_id` (None if the model has none) and `eos_token_id`.

`CharTokenizer` has a fixed vocabulary, so ids are stable across runs and checkpoints: pad=0, bos=1,
eos=2, unk=3, then one id per character of `CHAR_VOCAB` (digits, operators, ASCII letters, space,
newline and punctuation). A character outside it is an error unless `unknown="replace"`, which maps it
to unk. Special tokens decode to nothing with `skip_special=True`, else to their names ("<eos>").

`HFTokenizer` wraps `transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)`. Its
`vocab_size` is `len(tokenizer)` (added tokens included); a model's embedding table may be larger
(padded), never smaller. A missing pad token falls back to eos. `chat_template` is the tokenizer's
(None without one); `apply_chat_template(messages, **kwargs)` is the prompt's text with the
generation prompt added.

Both write themselves as a Hugging Face tokenizer (`save_pretrained(dir)`): the char tokenizer as a
`tokenizers` word-level model over single characters (the same ids, `AutoTokenizer` loads it), so a
checkpoint carries the tokenizer it was trained with.
"""

import string
from collections.abc import Sequence
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_VOCAB = string.digits + "+-*/=()<>#.,:;?!'\"$%&@[]{}^_|~`\\ \n" + string.ascii_lowercase + (
    string.ascii_uppercase
)


class CharTokenizer:
    """Character tokenizer with a fixed vocabulary (see the module docstring)."""

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    unk_token_id = 3

    def __init__(self, unknown: str = "error"):
        if unknown not in ("error", "replace"):
            raise ValueError(f"unknown must be 'error' or 'replace', got {unknown!r}")
        self.unknown = unknown
        self._itos = list(SPECIAL_TOKENS) + list(CHAR_VOCAB)
        self._stoi = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(CHAR_VOCAB)}

    @property
    def vocab_size(self) -> int:
        return len(self._itos)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_bos else []
        for pos, ch in enumerate(text):
            i = self._stoi.get(ch)
            if i is None:
                if self.unknown == "error":
                    raise ValueError(
                        f"character {ch!r} at position {pos} is not in the char tokenizer's vocabulary; "
                        "use CharTokenizer(unknown='replace') to map it to <unk>"
                    )
                i = self.unk_token_id
            ids.append(i)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    chat_template = None

    def save_pretrained(self, path) -> None:
        """The same tokenizer in Hugging Face form (tokenizer.json + tokenizer_config.json)."""
        self.to_hf().save_pretrained(str(path))

    def to_hf(self):
        """A `transformers.PreTrainedTokenizerFast` with this tokenizer's ids, encoding and decoding."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {tok: i for i, tok in enumerate(self._itos)}
        core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        core.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                       eos_token="<eos>", unk_token="<unk>",
                                       clean_up_tokenization_spaces=False)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self._itos):
                raise ValueError(f"token id {i} is outside the vocabulary [0, {len(self._itos)})")
            if i < len(SPECIAL_TOKENS):
                if not skip_special:
                    out.append(self._itos[i])
            else:
                out.append(self._itos[i])
        return "".join(out)


class HFTokenizer:
    """A model directory's own Hugging Face tokenizer behind the `CharTokenizer` interface."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ValueError(f"cannot load a tokenizer from {str(path)!r}: no such directory (a model or "
                             "tokenizer directory, or \"char\")")
        if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
            # AutoTokenizer would build some tokenizer of its own from config.json alone
            raise ValueError(f"{path} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}): give one with "
                             "model.tokenizer = DIR (or \"char\")")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {path!r} (local files only): {e}") from e
        tok = self.tokenizer
        if tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path!r} defines no eos token; generation could not stop")
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **kwargs)

    def save_pretrained(self, path) -> None:
        self.tokenizer.save_pretrained(str(path))

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def load_tokenizer(spec: str) -> CharTokenizer | HFTokenizer:
    """`"char"` gives the built-in `CharTokenizer`; anything else is a local model directory."""
    if spec == "char":
        return CharTokenizer()
    return HFTokenizer(spec)
