"""SASS of our kernels compiled for the H200 (sm_90) on a machine without a GPU: `triton.compile` to a
cubin, `nvdisasm` (shipped with Triton) to SASS, ptxas -v for registers and spills. The number to move
before spending GPU time (the quantize pair kernel went from ~25 to 15.5 instructions per element
this way).

- quantize: the pair kernel's main body (the IEEE-division slow path, a subroutine that normally
  never runs, excluded) over the elements one thread handles, codes and fused values;
- decode: the decode GEMM's tiles (`decode_gemm.DECODE_TILES`, K = 4096): instructions of the main
  loop per weight a thread dequantizes, registers, and shared-memory stores (a register-written MMA
  operand shows up as STS, and costs a fence before each MMA);
- grouped: the same for the MoE grouped decode kernel's tiles (`grouped_decode.GROUPED_DECODE_TILES`);
- gemm: the W4A4 GEMM on the bf16 copy (`gemm._w4a4_tma_kernel`, and the pointer kernel) at the
  aligned configs, alone and segmented (`gemm.gemm_segments`): that sm_90 compiles them (the CPU
  interpreter takes code the GPU compiler rejects), their MMAs, registers and spills.

- attention: the decode attention kernel for each KV format (bf16, fp8, nvfp4): which loads the
  loop issues asynchronously, its conversions, MMAs, registers and spills;
- builds: the kernels whose code branches on the operand dtype or the store, built for every variant;
- layouts: the kernels the two engines launch in different variants: their reductions' layouts.

    python -m benchmarks.tools.sass_kernels [quantize|decode|grouped|gemm|attention|builds|layouts]

With another Triton version first on the path (the GPU machine's: `pip install --target DIR
triton==3.6.0`, then `PYTHONPATH=DIR:.`), the same reports for that compiler.
"""

import argparse
import collections
import itertools
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kgemm
from minite.kernels import grouped_decode as gd
from minite.kernels.nvfp4 import pairs as kp

DECODE_SIGNATURE = {"a_ptr": "*bf16", "codes_ptr": "*i16", "ws_ptr": "*bf16", "sa_ptr": "*fp32",
                    "sw_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
                    "M": "i32", "N": "i32", "stride_am": "i32", "stride_om": "i32", "stride_sa": "i32",
                    "N1": "i32", "N2": "i32"}
GROUPED_SIGNATURE = {"a_ptr": "*bf16", "src_ptr": "*i32", "codes_ptr": "*i16", "ws_ptr": "*bf16",
                     "sa_ptr": "*fp32", "sw_ptr": "*fp32", "offsets_ptr": "*i32", "out_ptr": "*bf16",
                     "N": "i32", "E": "i32", "stride_am": "i32", "stride_ce": "i32", "stride_se": "i32",
                     "stride_om": "i32", "stride_sa": "i32", "N1": "i32", "N2": "i32"}
SIGNATURE = {"w_ptr": "*i32", "codes_ptr": "*u8", "scales_ptr": "*u8", "vals_ptr": "*i32",
             "sdec_out_ptr": "*fp32", "amax_out_ptr": "*fp32", "gs_ptr": "*fp32", "R": "i32",
             "stride_wr": "i32", "rows_per_gs": "i32"}


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, aligned=(),
                 num_stages: int | None = None):
    """fn compiled for sm_90 (num_stages: Triton's default unless given); pointers and the `aligned`
    ints are declared 16-divisible, as Triton's launcher specializes them at run time."""
    names = list(fn.arg_names)  # attributes are indexed by the argument's place among all of fn's
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in signature
             if signature[n].startswith("*") or n in aligned}
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    options = dict(num_warps=num_warps)
    if num_stages is not None:
        options["num_stages"] = num_stages
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def reduction_layouts(ttgir: str) -> list[str]:
    """Each floating-point sum's operand type in a kernel's TTGIR (shape and register layout, named
    layouts spelled out), in program order, with the reduced axis: what fixes a sum's order. Integer
    sums and max / min reductions are exact in any order and left out."""
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    out, axis, adds = [], None, False
    for line in ttgir.splitlines():
        start = re.search(r'"tt\.reduce"\(.*<\{axis = (\d+) : i32\}>', line)
        if start:
            axis, adds = start.group(1), False
        elif axis is not None and "arith.addf " in line:
            adds = True
        elif axis is not None and line.lstrip().startswith("}) : ("):
            operand = line.split("}) : (", 1)[1].split(") ->", 1)[0]
            if adds:
                named = re.sub(r"#\w+", lambda m: defs.get(m.group(0), m.group(0)), operand)
                out.append(f"axis {axis}: {named}")
            axis = None
    return out


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int, aligned=(),
                 num_stages: int | None = None) -> tuple[str, str]:
    """(SASS text, ptxas -v summary and the launch's shared memory) of fn for sm_90 (`compile_sm90`)."""
    k = compile_sm90(fn, signature, constexprs, num_warps, aligned, num_stages)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True,
                              text=True, check=True).stdout
        v = ""
        for ptxas in ("ptxas", "ptxas-blackwell"):  # newer Triton: only the latter reads its PTX version
            run = subprocess.run([os.path.join(bin_dir, ptxas), "-v", "--gpu-name", "sm_90a", ptx, "-o",
                                  os.devnull], capture_output=True, text=True)
            if run.returncode == 0:
                v = run.stderr
                break
    summary = " ".join(line.split("info    : ")[-1].strip() for line in v.splitlines()
                       if "Used" in line or "spill" in line)
    return sass, f"{summary}, {k.metadata.shared} bytes of shared memory"


def main_body_ops(sass: str) -> collections.Counter:
    """Opcode counts up to the first subroutine (the division slow path)."""
    ops = collections.Counter()
    for line in sass.splitlines():
        if "slowpath:" in line:
            break
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def main_loop_ops(sass: str) -> collections.Counter:
    """Opcode counts of the longest loop (a label up to the backward branch to it)."""
    labels, ins = {}, []
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            ins.append((m.group(1), m.group(2)))
    best = (0, -1)
    for i, (op, rest) in enumerate(ins):
        target = re.search(r"(\.L_x_\d+)", rest) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), i) < i and i - labels[target.group(1)] > best[1] - best[0]:
            best = (labels[target.group(1)], i)
    return collections.Counter(op.split(".")[0] for op, _ in ins[best[0]: best[1] + 1])


def quantize(k: int) -> None:
    kw = k // 2
    block_w = triton.next_power_of_2(kw)
    block_r = max(1, kp.CONFIG["WORDS"] // block_w)
    for mode in ("codes", "values"):
        words = kp.CONFIG["VALUES_WORDS_PER_THREAD" if mode == "values" else "WORDS_PER_THREAD"]
        warps = max(1, block_r * block_w // (32 * words))
        per_thread = 2 * block_r * block_w // (32 * warps)
        const = dict(KW=kw, GS=0, CHAIN=0, IN_BF16=True, WRITE_CODES=mode == "codes",
                     WRITE_VALUES=mode == "values", OUT_BF16=True, HW=True, EVEN=True,
                     BLOCK_R=block_r, BLOCK_W=block_w)
        sass, summary = compile_sass(kp._pairs_kernel, SIGNATURE, const, warps, aligned=("stride_wr",))
        ops = main_body_ops(sass)
        total = sum(ops.values())
        print(f"pair kernel, {mode}: {total} instructions for {per_thread} elements a thread = "
              f"{total / per_thread:.1f} per element ({summary})")
        print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))


def _loop_report(name, fn, signature, const, tile, aligned) -> None:
    sass, summary = compile_sass(fn, signature, const, tile["num_warps"], aligned=aligned)
    ops = main_loop_ops(sass)
    per_thread = tile["BN"] * tile["BK"] / (32 * tile["num_warps"])  # weights a thread dequantizes per step
    print(f"{name} {dict(BM=tile['BM'], BN=tile['BN'], BK=tile['BK'])}: main loop {sum(ops.values())} "
          f"instructions = {sum(ops.values()) / per_thread:.2f} per weight, STS {ops['STS']}, "
          f"LDS {ops['LDS'] + ops['LDSM']}, HGMMA {ops['HGMMA']} ({summary})")
    print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))


def decode(k: int) -> None:
    for bm, tile in kd.DECODE_TILES.items():
        t = {key: v for key, v in tile.items() if key in ("BM", "BN", "BK")}
        const = dict(K=k, TK=kd.tile_k(k), EPILOGUE=0, BF16=True, HW=True, W_SHIFT=kd.W_SHIFT[torch.bfloat16],
                     SPLIT_K=1, EVEN_N=True, SEGMENTED=False, **t)
        _loop_report(f"decode M<={bm}", kd._w4a4_decode_kernel, DECODE_SIGNATURE, const, tile,
                     ("stride_am", "stride_om"))


def grouped(k: int) -> None:
    for _, tile in gd.GROUPED_DECODE_TILES:
        t = dict(BM=tile["BM"], BN=tile["BN"], BK=tile["BK"])
        const = dict(K=k, TK=kd.tile_k(k), EPILOGUE=0, BF16=True, HW=True, W_SHIFT=kd.W_SHIFT[torch.bfloat16],
                     E_P2=128, EVEN_N=True, HALVES=tile.get("HALVES", False), SEGMENTED=False, GATHER=True,
                     **t)
        strides = ("stride_am", "stride_ce", "stride_se", "stride_om")
        name = "grouped decode" + (" halves" if tile.get("HALVES") else "")
        _loop_report(name, gd._grouped_decode_kernel, GROUPED_SIGNATURE, const, dict(tile, **t), strides)


GEMM_SIGNATURE = {"a_ptr": "*bf16", "w_ptr": "*bf16", "ws_ptr": "*bf16", "sa_ptr": "*fp32", "sw_ptr": "*fp32",
                  "out_ptr": "*bf16", "M": "i32", "N": "i32", "stride_am": "i32", "stride_wn": "i32",
                  "stride_wsn": "i32", "stride_om": "i32", "stride_sa": "i32", "programs": "i32", "N1": "i32",
                  "N2": "i32"}


def gemm(k: int) -> None:
    for config in ("aligned", "aligned_large"):
        tile = kgemm.CONFIGS[config]
        t = {key: tile[key] for key in ("BM", "BN", "BK", "GROUP_M")}
        for segmented in (False, True):
            tma = dict(K=k, EPILOGUE=0, PERSISTENT=bool(tile.get("PERSIST")),
                       FLATTEN=bool(tile.get("FLATTEN")), SEGMENTED=segmented, **t)
            pointer = dict(K=k, EPILOGUE=0, W_PACKED=False, DOT_F16=False, SEGMENTED=segmented, **t)
            kernels = (("tma", kgemm._w4a4_tma_kernel, tma), ("pointer", kgemm._w4a4_kernel, pointer))
            for name, fn, const in kernels:
                sig = {n: GEMM_SIGNATURE[n] for n in fn.arg_names if n not in const}
                sass, summary = compile_sass(fn, sig, const, tile["num_warps"],
                                             aligned=("stride_am", "stride_wn"))
                ops = main_loop_ops(sass)
                print(f"gemm {config} {name} segmented={segmented}: main loop HGMMA {ops['HGMMA']} "
                      f"({summary})")


def attention_args(kv: int, operand: str = "bf16") -> tuple[dict, dict, dict]:
    """(signature, constexprs, launch configuration) of the paged decode attention kernel
    (`attention._attention_kernel`, head_dim 128, 2 query heads per kv head) for KV format id `kv`
    (0 bf16, 1 fp8, 2 nvfp4) and q / out of dtype `operand` (bf16, fp16, fp32), as the GPU runs it."""
    from minite.kernels import attention as ka

    name = {0: "bf16", 1: "fp8", 2: "nvfp4"}[kv]
    cfg = ka.CONFIGS["gpu_fp32" if operand == "fp32" else "gpu" if kv == 0 else f"gpu_{name}"]
    const = dict(G=2, HKV=8, D=128, BLOCK_SIZE=16, PAGED=True, STORE_LSE=False, KV=kv, HW=True,
                 DOT_F32=operand == "fp32", PRECISION="ieee" if operand == "fp32" else "tf32",
                 WHILE_LOOP=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
    kv_ptr = f"*{operand}" if kv == 0 else "*u8"
    pointers = {"q_ptr": f"*{operand}", "out_ptr": f"*{operand}", "lse_ptr": "*fp32", "tiles_ptr": "*i32",
                "pos_ptr": "*i64", "table_ptr": "*i64", "start_ptr": "*i64", "ctx_ptr": "*i64",
                "ks_ptr": "*fp32", "vs_ptr": "*fp32", "k_ptr": kv_ptr, "v_ptr": kv_ptr, "kb_ptr": kv_ptr,
                "vb_ptr": kv_ptr}
    sig = {n: pointers.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in ka._attention_kernel.arg_names if n not in const}
    return sig, const, cfg


def attention(_k: int) -> None:
    """The decode attention kernel (`attention_args`, bf16 operands) for each KV format on that format's
    GPU configuration: its main loop's loads (LDGSTS: asynchronous copies the pipeliner issues ahead;
    LDG: loads the loop waits on), conversions, MMAs, registers, spills."""
    from minite.kernels import attention as ka

    for kv, name in ((0, "bf16"), (1, "fp8"), (2, "nvfp4")):
        sig, const, cfg = attention_args(kv)
        sass, summary = compile_sass(ka._attention_kernel, sig, const, cfg["num_warps"],
                                     aligned=tuple(n for n in sig if n.startswith("stride")),
                                     num_stages=cfg["num_stages"])
        ops = main_loop_ops(sass)
        total = sum(ops.values())
        print(f"attention, {name} KV: main loop {total} instructions per {cfg['BLOCK_N']}-key chunk, "
              f"LDGSTS {ops['LDGSTS']}, LDG {ops['LDG']}, F2F {ops['F2F'] + ops['F2FP']}, "
              f"HMMA {ops['HMMA']}, STS {ops['STS']} ({summary})")
        print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(14)))


def qk_norm_rope_args(operand: str) -> tuple[dict, dict]:
    """(signature, constexprs) of the q/k norm + RoPE kernel (`qk_norm_rope._qk_norm_rope_kernel`, head_dim
    128) for q / k of dtype `operand`: its one build, whatever it stores."""
    from minite.kernels import qk_norm_rope as kq

    bytes_ = ("kc_ptr", "vc_ptr", "kb_ptr", "vb_ptr")
    sig = {n: "*u8" if n in bytes_ else "*fp32" if n in ("ks_ptr", "vs_ptr") else "*i64" if n == "slot_ptr"
           else f"*{operand}" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32"
           for n in kq._qk_norm_rope_kernel.arg_names if n not in ("D", "BLOCK_R", "HW")}
    return sig, dict(D=128, BLOCK_R=kq.ELEMS // 128, HW=True)


def builds(k: int) -> None:
    """Build for sm_90 the kernels whose helpers branch on the operand dtype: decode attention for
    every operand dtype and KV format, the q/k norm + RoPE with its cache stores for each, the W4A4 GEMM
    on packed weights for bf16 and fp16 activations; exit 1 if one fails (a GPU-only compile error found
    without a GPU)."""
    from minite.kernels import attention as ka
    from minite.kernels import qk_norm_rope as kq

    variants = []
    for operand in ("bf16", "fp16", "fp32"):
        for kv, name in ((0, "bf16"), (1, "fp8"), (2, "nvfp4")):
            sig, const, cfg = attention_args(kv, operand)
            variants.append((f"attention, {operand} operands, {name} KV", ka._attention_kernel, sig, const,
                             cfg["num_warps"], cfg["num_stages"]))
        sig, const = qk_norm_rope_args(operand)
        variants.append((f"q/k norm + RoPE, {operand}", kq._qk_norm_rope_kernel, sig, const, 4, None))
    tile = kgemm.CONFIGS["aligned"]
    for operand in ("bf16", "fp16"):
        const = dict(K=k, EPILOGUE=0, W_PACKED=True, DOT_F16=operand == "fp16", SEGMENTED=False,
                     **{key: tile[key] for key in ("BM", "BN", "BK", "GROUP_M")})
        sig = {n: GEMM_SIGNATURE[n] for n in kgemm._w4a4_kernel.arg_names if n not in const}
        sig.update(a_ptr=f"*{operand}", out_ptr=f"*{operand}", w_ptr="*u8", ws_ptr="*u8")
        variants.append((f"W4A4 GEMM, packed weights, {operand} activations", kgemm._w4a4_kernel, sig, const,
                         tile["num_warps"], tile["num_stages"]))
    failed = []
    for label, fn, sig, const, warps, stages in variants:
        try:
            _, summary = compile_sass(fn, sig, const, warps, num_stages=stages)
            print(f"{label}: built ({summary})")
        except Exception as e:  # noqa: BLE001 - report every variant, then fail
            failed.append(label)
            print(f"{label}: FAILED {str(e).strip().splitlines()[-1]}")
    if failed:
        raise SystemExit(f"did not build: {'; '.join(failed)}")


NORM_PAIRS_SIGNATURE = dict(x_ptr="*i32", w_ptr="*i32", out_ptr="*i32", vals_ptr="*i32", scales_ptr="*u8",
                            sdec_ptr="*fp32", amax_ptr="*fp32", res_ptr="*i32", h_ptr="*i32", n_rows="i32",
                            stride_xw="i32", stride_rw="i32", eps="fp32", D="i32")


def layouts(_k: int) -> None:
    """The kernels the two engines launch in different variants, built for sm_90 in each: the layouts of
    their floating-point sums (hence the sums' order, hence their bits) must not depend on the variant.
    The norm on 16-bit words (`norm_pairs`: the sampler's residual add or not, rows a multiple of the
    block or not, quantizing or not, one row) at hidden sizes 2048 and 4096; the MoE gate + routing
    (chunks as programs of their own or not, counting for the sort or not, one token; top-k
    renormalized or not); attention per KV format (paged or packed keys, with or without the
    backward's log-sum-exp). Exit 1 where a kernel's variants differ (conservative: a sum exact in any
    order, one term and zeros, counts too).
    The q/k norm + RoPE kernel is one build for every launch (`qk_norm_rope.UNSPECIALIZED`)."""
    from minite.kernels import attention as ka
    from minite.kernels import norm_pairs as kn
    from minite.kernels import router as kr

    groups = {}
    for d in (2048, 4096):
        kw = d // 2
        bw = max(8, 1 << (kw - 1).bit_length())
        br = max(1, kn.WORDS // bw)
        warps = min(16, max(1, br * bw // (32 * kn.WORDS_PER_THREAD)))
        # every variant, and one row (Triton compiles an integer argument of 1 as a constant: a single
        # sequence's decode step) in the sampler's
        variants = [(*v, False) for v in itertools.product((False, True), repeat=3)]
        for resid, even, quant, one in variants + [(True, False, True, True)]:
            const = dict(KW=kw, QUANT=quant, CHAIN=0, RESIDUAL=resid, BF16=True, VALS_BF16=True, HW=True,
                         EVEN=even, BLOCK_R=br, NB=bw // 8, **({"n_rows": 1} if one else {}))
            sig = {n: t for n, t in NORM_PAIRS_SIGNATURE.items() if n not in const}
            k = compile_sm90(kn._norm_pairs_kernel, sig, const, warps,
                             aligned=("stride_xw", "stride_rw", "D"))
            groups.setdefault(f"norm_pairs, D {d}", []).append(reduction_layouts(k.asm["ttgir"]))
    gate_sig = dict(x_ptr="*bf16", g_ptr="*bf16", part_ptr="*fp32", sem_ptr="*i32", logits_ptr="*bf16",
                    w_ptr="*bf16", ids_ptr="*i64", counts_ptr="*i32", T="i32", H="i32", E="i32",
                    stride_x="i32", stride_g="i32")
    gate_variants = [(*v, False) for v in itertools.product((True, False), repeat=3)]
    for norm, split, count, one in gate_variants + [(True, True, True, True), (False, True, True, True)]:
        const = dict(K=8, K_P2=8, E_P2=128, NORMALIZE=norm, BLOCK_T=kr.gate_rows(8), BLOCK_H=kr.GATE_CHUNK,
                     SPLIT=split, COUNT=count, IEEE=False, **({"T": 1} if one else {}))
        sig = {n: t for n, t in gate_sig.items() if n not in const}
        k = compile_sm90(kr._gate_route_kernel, sig, const, kr.GATE_CONFIG["num_warps"],
                         aligned=("H", "stride_x", "stride_g"))
        label = f"gate + routing, 128 experts, top-8 {'renormalized' if norm else 'of the softmax'}"
        groups.setdefault(label, []).append(reduction_layouts(k.asm["ttgir"]))
    for kv, name in ((0, "bf16"), (1, "fp8"), (2, "nvfp4")):
        sig, const, cfg = attention_args(kv)
        for paged, lse in itertools.product((False, True), repeat=2):
            k = compile_sm90(ka._attention_kernel, sig, dict(const, PAGED=paged, STORE_LSE=lse),
                             cfg["num_warps"], aligned=tuple(n for n in sig if n.startswith("stride")),
                             num_stages=cfg["num_stages"])
            groups.setdefault(f"attention, {name} KV", []).append(reduction_layouts(k.asm["ttgir"]))
    differ = []
    for label, variants in groups.items():
        same = all(v == variants[0] for v in variants)
        print(f"{label}: {len(variants)} variants, {len(variants[0])} reductions, "
              f"{'one layout each' if same else 'LAYOUTS DIFFER'}")
        if not same:
            differ.append(label)
            for v in variants:
                print("   ", v)
    if differ:
        raise SystemExit(f"reduction layouts depend on the variant: {'; '.join(differ)}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", nargs="?", default="quantize",
                   choices=["quantize", "decode", "grouped", "gemm", "attention", "builds", "layouts"])
    p.add_argument("--k", type=int, default=4096, help="row width / reduction length (elements)")
    args = p.parse_args()
    dict(quantize=quantize, decode=decode, grouped=grouped, gemm=gemm, attention=attention,
         builds=builds, layouts=layouts)[args.what](args.k)


if __name__ == "__main__":
    main()
