"""Read a ModelOpt or compressed-tensors NVFP4 checkpoint without quantizing anything.

`minite.models.load_pretrained` opens it like any Hugging Face directory; the quantized linears
(`minite.models.nvfp4_formats`: codes, block scales, global scales, static input scales) are read
here, per checkpoint module (`minite.models.nvfp4_layout`), into containers: one per parameter (an
MoE layer's experts stacked, each expert's gate and up rows together, one global scale per expert),
one per segment of a segmented projection (q|k|v, gate|up). The parameter is set to the dequantized
values (e2m1 * s_b * S_dec, in the load dtype) and carries the containers
(`minite.nn.pinned_weights`): every recipe with the checkpoint's block shape then computes with the
checkpoint's codes and scales as they are (the sampler, `minite agreement`, `minite diagnose`), until
the weights are updated. Static input scales go to the modules' `input_scale` buffers (a segmented
projection or an MoE projection takes the largest over its pieces, as vLLM does).

The block shape is 1x16 unless `minite_nvfp4.json` (written by our export) records the exporting
recipe's (16x16 for `te`); that file also restores what the format rounds (S_dec from 1 / S_enc, the
weight amax for TE's GEMM alpha, static input scales from their reciprocals), wherever it agrees with
the format's tensors. Without it the amax is taken as 2688 * S_dec.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minite.models.hf_layout import CheckpointError
from minite.models.nvfp4_formats import FIELDS, SIDECAR, detect, from_hex, global_from_file, input_from_file
from minite.models.nvfp4_layout import CheckpointModule, checkpoint_modules
from minite.nn.pinned_weights import pin
from minite.nvfp4 import NVFP4Tensor

TE_AMAX_TO_SCALE = 2688.0


class NVFP4Checkpoint:
    """The quantized part of an NVFP4 checkpoint: which tensors it owns, which parameters it gives."""

    @classmethod
    def open(cls, path: Path, hf_config: dict, model, files: dict[str, Path]) -> NVFP4Checkpoint | None:
        fmt = detect(path, hf_config)
        return None if fmt is None else cls(path, fmt, model, files)

    def __init__(self, path: Path, fmt: str, model, files: dict[str, Path]):
        self.path, self.fmt = path, fmt
        codes, scales, glob, inp = FIELDS[fmt]
        present = [e for e in checkpoint_modules(model) if f"{e.name}.{scales}" in files]
        self.by_param: dict[str, list[CheckpointModule]] = {}
        for e in present:
            self.by_param.setdefault(e.param, []).append(e)
        for e in checkpoint_modules(model):
            if e.param in self.by_param and e not in present:
                raise CheckpointError(f"{path} quantizes some modules of {e.param} but not {e.name} "
                                      f"(it lacks {e.name}.{scales})")
        self.params = set(self.by_param)
        self.tensors = {f"{e.name}.{f}" for e in present for f in (codes, scales, glob, inp)
                        if f"{e.name}.{f}" in files}
        for e in present:
            for f in (codes, glob):
                if f"{e.name}.{f}" not in files:
                    raise CheckpointError(f"checkpoint {path} lacks tensor {e.name}.{f}")
        side = path / SIDECAR
        self.sidecar = json.loads(side.read_text()) if side.is_file() else {}
        self.block = tuple(self.sidecar.get("weight_block", (1, 16)))
        self.containers: dict[str, list[NVFP4Tensor]] = {}
        self.input_scales: dict[tuple[int, str], tuple] = {}  # (id(module), buffer) -> (module, scales)

    def read(self, reader, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        """The dequantized parameters {our name: tensor}, keeping each one's containers."""
        state = {}
        for param, entries in self.by_param.items():
            qs = self._containers(reader, param, entries)
            self.containers[param] = qs
            state[param] = torch.cat([q.dequantize() for q in qs], dim=-2).to(device=device, dtype=dtype)
        return state

    def install(self, model) -> None:
        """Pin the containers to the loaded model's parameters; set the static input scales."""
        params = dict(model.named_parameters())
        for name, qs in self.containers.items():
            pin(params[name], [q.to(params[name].device) for q in qs])
        for module, buffer, scales in self.input_scales.values():
            device = getattr(module, "weight", next(module.parameters())).device
            setattr(module, buffer, torch.stack(scales).amax().to(device))

    def _containers(self, reader, param: str, entries: list[CheckpointModule]) -> list[NVFP4Tensor]:
        """One container per segment of a `SegmentedLinear`, else one (an MoE layer's experts stacked)."""
        codes_f, scales_f, glob_f, inp_f = FIELDS[self.fmt]
        module = entries[0].module
        shape = tuple(getattr(module, entries[0].leaf).shape)
        k = shape[-1]
        experts: dict[int | None, list] = {}  # part (segment or expert) -> its rows' pieces
        for e in entries:
            n = e.rows.stop - e.rows.start
            codes = self._tensor(reader, f"{e.name}.{codes_f}", (n, k // 2), torch.uint8)
            sb = self._tensor(reader, f"{e.name}.{scales_f}", (n, k // 16), torch.float8_e4m3fn)
            file_g = self._tensor(reader, f"{e.name}.{glob_f}", None, torch.float32)
            s_dec, amax = self._global(e.name, file_g)
            experts.setdefault(e.part, []).append((codes, sb, s_dec, amax, e.name))
            if f"{e.name}.{inp_f}" in reader.files:
                scale = self._input(e.name, self._tensor(reader, f"{e.name}.{inp_f}", None, torch.float32))
                key = (id(module), e.input_scale_buffer)
                self.input_scales.setdefault(key, (module, e.input_scale_buffer, []))[2].append(scale)
        parts = []
        for rows in experts.values():
            s_decs = torch.stack([r[2] for r in rows])
            if not torch.equal(s_decs, s_decs[:1].expand_as(s_decs)):  # an expert's gate and up
                raise CheckpointError(f"{rows[0][4]} and {rows[1][4]} have different global scales; "
                                      f"{param} holds one per expert")
            codes, sb = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
            parts.append((codes, sb, rows[0][2], rows[0][3]))
        if len(shape) == 2:  # a Linear, or a SegmentedLinear's segments
            return [NVFP4Tensor(c, sb, s_dec, amax, (c.shape[0], k), self.block, "tensor", "te", False)
                    for c, sb, s_dec, amax in parts]
        codes, sb = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        s_dec = torch.stack([p[2] for p in parts]).reshape(-1, 1, 1)
        amax = torch.stack([p[3] for p in parts]).reshape(-1, 1, 1)
        return [NVFP4Tensor(codes, sb, s_dec, amax, shape, self.block, "tensor", "te", False)]

    def _tensor(self, reader, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        t = reader.get(name, shape)
        if t.dtype != dtype:
            raise CheckpointError(f"tensor {name} is {t.dtype} in {self.path}, expected {dtype} ({self.fmt})")
        if shape is None and t.numel() != 1:
            raise CheckpointError(f"tensor {name} has shape {list(t.shape)} in {self.path}, expected one "
                                  "value")
        return t

    def _global(self, name: str, file_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S_dec, amax) of one module: the sidecar's exact values where they agree with the file's."""
        s_dec = global_from_file(self.fmt, file_g)
        side = self.sidecar.get("modules", {}).get(name)
        if side:
            exact = from_hex(side["s_dec"]).reshape(())
            consistent = torch.equal(exact, file_g.reshape(())) if self.fmt == "modelopt" else \
                torch.equal((1.0 / exact).reshape(()), file_g.float().reshape(()))
            if consistent:
                return exact, from_hex(side["amax"]).reshape(())
        return s_dec, s_dec * TE_AMAX_TO_SCALE

    def _input(self, name: str, file_s: torch.Tensor) -> torch.Tensor:
        scale = input_from_file(self.fmt, file_s)
        side = (self.sidecar.get("modules", {}).get(name) or {}).get("input_scale")
        if side:
            exact = from_hex([side]).reshape(())
            back = exact if self.fmt == "modelopt" else 1.0 / exact
            if torch.equal(back.reshape(()), file_s.float().reshape(())):
                return exact
        return scale
