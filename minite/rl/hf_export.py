"""A trained model as a complete Hugging Face directory: what `AutoModelForCausalLM`,
`AutoTokenizer` and `GenerationConfig.from_pretrained` load, and what `minite eval` and
`minite train --model.path` take back.

    config.json, model.safetensors (or shards + index)   `minite.models.save_pretrained`
    tokenizer.json, tokenizer_config.json, chat template  the run's tokenizer (the char tokenizer in its
                                                          Hugging Face form)
    generation_config.json                                the source model's (its sampling defaults kept),
                                                          its `eos_token_id` the run's stop ids

`save_hf_directory` writes into a hidden temporary sibling and renames it into place (an earlier
directory at `path` is replaced only once the new one is whole); `write_hf_extras` adds the
tokenizer and generation files to a directory being written (a checkpoint's model folder).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from minite.files import writing
from minite.models import save_pretrained
from minite.models.checkpoint import swap_into_place
from minite.rl.prompts import GENERATION_CONFIG


def generation_config(tokenizer, stop_ids: tuple[int, ...], source_dir: str | Path = "") -> dict:
    """The source directory's generation_config.json with `eos_token_id` = the stop ids."""
    file = Path(source_dir) / GENERATION_CONFIG if source_dir else None
    config = json.loads(file.read_text()) if file is not None and file.is_file() else {}
    config["eos_token_id"] = list(stop_ids) if len(stop_ids) > 1 else stop_ids[0]
    if tokenizer.bos_token_id is not None:
        config.setdefault("bos_token_id", tokenizer.bos_token_id)
    config.setdefault("pad_token_id", tokenizer.pad_token_id)
    return config


def write_hf_extras(path: str | Path, tokenizer, stop_ids: tuple[int, ...],
                    source_dir: str | Path = "") -> None:
    """Tokenizer files and generation_config.json into the model directory `path`."""
    path = Path(path)
    with writing(path):
        tokenizer.save_pretrained(path)
        config = generation_config(tokenizer, stop_ids, source_dir)
        (path / GENERATION_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def save_hf_directory(model, path: str | Path, tokenizer, stop_ids: tuple[int, ...],
                      source_dir: str | Path = "") -> Path:
    """Write the whole directory (see the module docstring) at `path`, replacing one there."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_pretrained(model, tmp)
        write_hf_extras(tmp, tokenizer, stop_ids, source_dir)
        swap_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
