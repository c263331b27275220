"""From a task's prompt text to the ids the sampler is given, and where a response ends.

- `PromptFormat.encode(tokenizer, prompt)`: with `chat_template` on and a tokenizer that has one, the
  prompt is a user turn (after a system turn when `system_prompt` is set) rendered by the template with
  the generation prompt and `template_kwargs` (e.g. `enable_thinking=False` for Qwen3); otherwise the
  text itself (after `system_prompt` and a blank line, when set), behind the bos token if the
  tokenizer has one.
- `stop_token_ids(tokenizer, model_dir)`: the tokenizer's eos, then every `eos_token_id` of the model
  directory's generation_config.json (an id or a list: Qwen3 instruct models stop at <|im_end|> and
  <|endoftext|>).
- `cut_at_stop_strings(sample, tokenizer, stops)`: a sampled response cut after the first token whose
  text completes a stop string (the sampler stops on ids only; the tokens after it are dropped, so they
  neither score nor train), marked `finish_reason = "stop"`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class PromptFormat:
    chat_template: bool = True
    system_prompt: str = ""
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def uses_template(self, tokenizer) -> bool:
        return self.chat_template and getattr(tokenizer, "chat_template", None) is not None

    def encode(self, tokenizer, prompt: str) -> list[int]:
        if self.uses_template(tokenizer):
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            messages.append({"role": "user", "content": prompt})
            text = tokenizer.apply_chat_template(messages, **self.template_kwargs)
            return tokenizer.encode(text)
        text = f"{self.system_prompt}\n\n{prompt}" if self.system_prompt else prompt
        return tokenizer.encode(text, add_bos=tokenizer.bos_token_id is not None)


def generation_config_stop_ids(model_dir: str | Path) -> list[int]:
    """`eos_token_id` of `model_dir/generation_config.json` as a list ([] without the file or key)."""
    file = Path(model_dir) / GENERATION_CONFIG
    if not model_dir or not file.is_file():
        return []
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{file} is not a JSON object; fix or remove it") from None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file}: eos_token_id={eos!r} must be an id or a list of ids")
    return ids


def stop_token_ids(tokenizer, model_dir: str | Path = "") -> tuple[int, ...]:
    ids = [tokenizer.eos_token_id, *generation_config_stop_ids(model_dir)]
    return tuple(dict.fromkeys(ids))


def cut_at_stop_strings(sample, tokenizer, stops: list[str]):
    """`sample` (token_ids, logprobs, finish_reason) ending after the first stop string, or as it is."""
    if not stops:
        return sample
    ids = sample.token_ids
    text = tokenizer.decode(ids)
    if not any(s in text for s in stops):
        return sample
    # the shortest prefix whose text holds a stop string (texts of prefixes grow with the prefix)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return replace(sample, token_ids=list(ids[:lo]), logprobs=sample.logprobs[:lo], finish_reason="stop")
