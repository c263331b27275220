"""Localization: where in the network two execution paths start to disagree, and how it grows with depth.

An execution path (`Side`) is a recipe plus a batch composition: `"packed"` runs all sequences in one
forward (packed back to back with `cu_seqlens`, as a learner micro-batch), `"alone"` runs every
sequence in a forward of its own. Both sides use the same model (same master weights), switched
between recipes with `Qwen3.set_recipe`. Here the sampler's path for a given token sequence is the
model's full forward under the sampler recipe; `minite diagnose` compares it with the sampler
engine's own decode log-probs (`minite.sampler`).

`localize` feeds the same sequences through both sides, each running the model's own forward, and
records with forward hooks on its modules, for every op in execution order (per layer, `LAYER_POINTS`:
input_layernorm, q_proj, k_proj, v_proj, attn (the attention output, o_proj's input), o_proj,
post_attention_layernorm, router (MoE), mlp (the MLP or MoE block; a MoE block, which adds the
residual in its combine, is recorded as what it adds to the residual stream: its output less the
residual, in fp64), output (the residual stream after the layer); then final norm and lm_head
(logits)), the relative difference

    rel_diff = ||a - b|| / ||b||      (Frobenius norm over all tokens, a = side A, b = side B, fp64)

For MoE layers it also records router agreement: the share of tokens whose top-k expert set is the
same on both sides (`router_topk_same`) and the mean overlap of the two sets (`router_topk_overlap`).
`first_divergent` is the first op in execution order with rel_diff > tol.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from minite.nn.calibrate import calibrate, needs_calibration
from minite.recipe import Recipe, get_recipe
from minite.sampling import token_logprobs

BATCHINGS = ("packed", "alone")
# Each decoder layer's ops in execution order: (op kind, the module under the layer whose forward hook
# records it ("": the layer itself), whether the op is that module's input rather than its output).
# A layer without the module (a dense layer has no router) has no such op.
LAYER_POINTS = (
    ("input_layernorm", "input_layernorm", False),
    ("q_proj", "self_attn.qkv_proj", False), ("k_proj", "self_attn.qkv_proj", False),
    ("v_proj", "self_attn.qkv_proj", False),
    ("attn", "self_attn.o_proj", True), ("o_proj", "self_attn.o_proj", False),
    ("post_attention_layernorm", "post_attention_layernorm", False),
    ("router", "mlp.gate", False), ("mlp", "mlp", False), ("output", "", False),
)
# which element of a module's tuple output an op is: a segmented projection's segment (else the first:
# a norm's output, before the quantization it hands over)
OUTPUT_PART = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


@dataclass(frozen=True)
class Side:
    """One execution path: a recipe and how sequences are batched (see the module docstring)."""

    recipe: Recipe
    batching: str = "packed"
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "recipe", get_recipe(self.recipe))
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching={self.batching!r} is not supported; choose one of {list(BATCHINGS)}")
        if not self.name:
            object.__setattr__(self, "name", f"{self.recipe.name}/{self.batching}")

    def replace(self, **changes) -> Side:
        fields = {"recipe": self.recipe, "batching": self.batching, "name": "", **changes}
        return Side(**fields)


@dataclass
class Sequences:
    """Token sequences (prompt + response) and where each response starts."""

    tokens: list[list[int]]
    prompt_lens: list[int]

    def __post_init__(self):
        if not self.tokens or len(self.tokens) != len(self.prompt_lens):
            raise ValueError("Sequences needs one prompt length per (non-empty) list of sequences")
        for s, p in zip(self.tokens, self.prompt_lens):
            if not 1 <= p <= len(s):
                raise ValueError(f"prompt length {p} outside [1, {len(s)}] for a sequence of {len(s)} tokens")

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Target tokens `[B, T]` (T = longest sequence - 1; position t predicts token t + 1) and the
        response mask `[B, T]` (True where the target is a response token)."""
        T = max(len(s) for s in self.tokens) - 1
        targets = torch.zeros(len(self.tokens), T, dtype=torch.long)
        mask = torch.zeros(len(self.tokens), T, dtype=torch.bool)
        for i, (s, p) in enumerate(zip(self.tokens, self.prompt_lens)):
            targets[i, : len(s) - 1] = torch.tensor(s[1:])
            mask[i, p - 1: len(s) - 1] = True
        return targets, mask


@torch.no_grad()
def prepare(model: nn.Module, seqs: Sequences, sides: list[Side]) -> None:
    """Calibrate static activation scales on `seqs` if a side needs them and the model has none."""
    if any(s.recipe.activation.scaling == "static" for s in sides) and needs_calibration(model):
        with calibrate(model):
            _forward_logits(model, seqs, "packed")


def _forward_logits(model, seqs: Sequences, batching: str) -> list[torch.Tensor]:
    device = model.embed_tokens.weight.device
    if batching == "alone":
        return [model(torch.tensor([s], device=device))[0] for s in seqs.tokens]
    lens = [len(s) for s in seqs.tokens]
    ids = torch.tensor([sum(seqs.tokens, [])], device=device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    return list(model(ids, cu_seqlens=cu)[0].split(lens))


@contextmanager
def recipe_of(model, side: Side):
    """Run `model` under `side.recipe` inside the block, then restore its recipe."""
    before = model.recipe
    model.set_recipe(side.recipe)
    try:
        yield model
    finally:
        model.set_recipe(before)


@torch.no_grad()
def side_logits(model, side: Side, seqs: Sequences) -> list[torch.Tensor]:
    """Each sequence's logits [len, V] on `side`."""
    with recipe_of(model, side):
        return _forward_logits(model, seqs, side.batching)


@torch.no_grad()
def side_logprobs(model, side: Side, seqs: Sequences, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-probs `[B, T]` of each next token (aligned with `Sequences.padded`; 0 past a sequence)."""
    targets, _ = seqs.padded()
    out = torch.zeros(targets.shape)
    with recipe_of(model, side):
        logits = _forward_logits(model, seqs, side.batching)
        execution = model.recipe.execution
    for i, (lg, s) in enumerate(zip(logits, seqs.tokens)):
        out[i, : len(s) - 1] = token_logprobs(lg[:-1], torch.tensor(s[1:], device=lg.device),
                                              temperature, execution=execution).cpu()
    return out


def _hook_points(model) -> list[tuple[str, nn.Module, bool, int]]:
    """(op name, module, capture its input instead of its output, element of a tuple) for every op of
    `LAYER_POINTS` the model's layers have, then the final norm and the logits (the model's output)."""
    points = []
    for i, layer in enumerate(model.layers):
        for kind, path, use_input in LAYER_POINTS:
            module = _submodule(layer, path)
            if module is not None:
                points.append((f"layers.{i}.{kind}", module, use_input, OUTPUT_PART.get(kind, 0)))
    return points + [("norm", model.norm, False, 0), ("lm_head", model, False, 0)]


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _op_output(out, residual: torch.Tensor | None, part: int) -> torch.Tensor:
    """The op's tensor in a module's output. A module handed the residual returns either (x +
    residual, its own output) (a norm) or residual + its output (a MoE block: then what it adds)."""
    if residual is not None:
        if not isinstance(out, tuple):
            return out.double() - residual.double()
        out = out[1]
    return out[part] if isinstance(out, tuple) else out


@contextmanager
def _on_every_op(model, fn):
    """Inside the block, fn(op name, its tensor as detached `[tokens, features]` rows) on each call
    of every hook point."""
    handles = []
    by_module: dict[nn.Module, list] = {}
    for name, module, use_input, part in _hook_points(model):
        by_module.setdefault(module, []).append((name, use_input, part))
    for module, ops in by_module.items():  # one hook per module, its ops in LAYER_POINTS order
        def hook(mod, args, kwargs, out, ops=ops):
            for name, use_input, part in ops:
                t = args[0] if use_input else _op_output(out, kwargs.get("residual"), part)
                fn(name, t.detach().reshape(-1, t.shape[-1]))
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture(model):
    """Record every hook point's tensor as `[tokens, features]` rows, on its device and in its dtype
    (exact: no conversion), concatenated over calls at the end of the block."""
    store: dict[str, list[torch.Tensor]] = {}
    with _on_every_op(model, lambda name, t: store.setdefault(name, []).append(t.clone())):
        yield store
    for name, parts in store.items():
        store[name] = [torch.cat(parts)]


class _Compare:
    """Running fp64 sums of one op's ||a - b||^2 and ||b||^2 (and router agreement) while side B runs,
    against side A's captured rows; row chunks bound the fp64 temporaries (logits are [T, vocab])."""

    CHUNK = 512

    def __init__(self, a: torch.Tensor, top_k: int | None):
        self.a, self.top_k, self.row = a, top_k, 0
        zero = torch.zeros((), dtype=torch.float64, device=a.device)
        self.sums = {"num": zero.clone(), "den": zero.clone(), "same": zero.clone(), "overlap": zero.clone()}

    def add(self, b: torch.Tensor) -> None:
        for s in range(0, b.shape[0], self.CHUNK):
            bb = b[s: s + self.CHUNK].double()
            aa = self.a[self.row + s: self.row + s + bb.shape[0]].double()
            self.sums["num"] += (aa - bb).square().sum()
            self.sums["den"] += bb.square().sum()
            if self.top_k:
                ta = aa.topk(self.top_k, dim=-1).indices.sort(-1).values
                tb = bb.topk(self.top_k, dim=-1).indices.sort(-1).values
                self.sums["same"] += (ta == tb).all(-1).double().sum()
                self.sums["overlap"] += (ta[:, :, None] == tb[:, None, :]).any(-1).double().mean(-1).sum()
        self.row += b.shape[0]

    def result(self) -> dict:
        num, den = self.sums["num"].sqrt().item(), self.sums["den"].sqrt().item()
        out = {"rel_diff": (0.0 if num == 0 else float("inf")) if den == 0 else num / den}
        if self.top_k:
            n = max(self.row, 1)
            out.update(router_topk_same=self.sums["same"].item() / n,
                       router_topk_overlap=self.sums["overlap"].item() / n)
        return out


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (0 when both are 0, inf when only b is)."""
    c = _Compare(a.reshape(-1, a.shape[-1]) if a.dim() else a.reshape(1, 1), None)
    c.add(b.reshape(-1, b.shape[-1]) if b.dim() else b.reshape(1, 1))
    return c.result()["rel_diff"]


@contextmanager
def compare(model, reference: dict[str, list[torch.Tensor]]):
    """While the block runs side B, compare every hook point's tensor with side A's (`capture`) row
    by row; yields {op: _Compare}."""
    cmp = {name: _Compare(reference[name][0], model.layers[int(name.split(".")[1])].mlp.top_k
                          if name.endswith(".router") else None)
           for name, _, _, _ in _hook_points(model)}
    with _on_every_op(model, lambda name, t: cmp[name].add(t)):
        yield cmp


@dataclass
class Localization:
    ops: list[dict]  # execution order: {"op", "layer", "kind", "rel_diff"} (+ router agreement)
    first_divergent: str | None
    side_a: str
    side_b: str

    def layer_curve(self, kind: str = "output") -> list[float]:
        """rel_diff of op `kind` per layer (the residual stream by default)."""
        return [o["rel_diff"] for o in self.ops if o["kind"] == kind and o["layer"] is not None]

    def to_dict(self) -> dict:
        return {"side_a": self.side_a, "side_b": self.side_b, "first_divergent": self.first_divergent,
                "ops": self.ops}


@torch.no_grad()
def localize(model, side_a: Side, side_b: Side, seqs: Sequences, tol: float = 0.0) -> Localization:
    """Per-op relative differences of side A against side B on the same sequences."""
    prepare(model, seqs, [side_a, side_b])
    with recipe_of(model, side_a), capture(model) as reference:
        _forward_logits(model, seqs, side_a.batching)
    with recipe_of(model, side_b), compare(model, reference) as cmp:
        _forward_logits(model, seqs, side_b.batching)
    del reference
    ops = []
    for name, _, _, _ in _hook_points(model):
        parts = name.split(".")
        layer = int(parts[1]) if parts[0] == "layers" else None
        ops.append({"op": name, "layer": layer, "kind": parts[-1], **cmp[name].result()})
    first = next((o["op"] for o in ops if o["rel_diff"] > tol), None)
    return Localization(ops, first, side_a.name, side_b.name)
