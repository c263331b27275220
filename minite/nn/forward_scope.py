"""One model forward's memos: what every layer would otherwise rebuild from the same inputs.

`Qwen3.hidden_states` (every engine's forward) wraps its layer loop in `forward_scope()`; a checkpointed
layer's recompute opens its own. Inside it, `scope_memo(name)` hands out one dict per name, dropped when
the forward ends; outside a scope it returns None and callers compute as usual. User: the RoPE cos/sin
tables (`minite.nn.rope`). What the forward's step fixes in advance (the attention layout) lives in its
context instead (`minite.nn.context`); a quantized input is handed from op to op explicitly
(`nvfp4_matmul.QuantizedActivation`). Each memo keeps a reference to the tensors it was keyed on, so
their memory (and so their `id` / `data_ptr`) cannot be reused meanwhile.
"""

from __future__ import annotations

from contextlib import contextmanager

_STACK: list[dict[str, dict]] = []


@contextmanager
def forward_scope():
    _STACK.append({})
    try:
        yield
    finally:
        _STACK.pop()


def scope_memo(name: str) -> dict | None:
    """The current forward's memo for `name` (None outside `forward_scope`)."""
    return _STACK[-1].setdefault(name, {}) if _STACK else None


def in_scope() -> bool:
    return bool(_STACK)
