"""Registers, spill stack and SASS instruction count of fp8/fast/kernels.py's quantization kernel for sm_90,
compiled on this machine (no GPU needed: Triton's own LLVM and bundled ptxas / cuobjdump).

    python -m scripts.kernel_regs                       # the default launches of modes 0, 1, 2
    python -m scripts.kernel_regs 1,8,2 2,4,0 1,8,1,2   # split,warps,mode[,stages]

The kernel is compiled with the specializations Triton applies at run time to 16-byte-aligned
pointers and sizes divisible by 16 (`tt.divisibility`); without them the loads are not vectorized
and the counts are unlike the GPU's. With them they match ncu's "Registers Per Thread" (222 / 236 / 255
for the float64-scale kernel, reproduced here). mode: 0 quant_dual, 1 SwiGLU forward,
2 SwiGLU backward; stages 0 = one program per tile (the two-number launch).
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp8.fast import kernels
from fp8.quant import FP8_MAX, TORCHAO_EPS

ARGS = {"x_ptr": "*bf16", "gu_ptr": "*bf16", "x_out_ptr": "*bf16", "q_row_ptr": "*fp8e4nv", "s_row_ptr": "*fp32",
        "q_col_ptr": "*fp8e4nv", "s_col_ptr": "*fp32", "MT": "i32", "K": "i32"}  # all 16-aligned / divisible
CONSTEXPRS = ["BLOCK", "SPLIT", "MODE", "COLS", "STORE_X", "STAGES", "EPS", "FP8_MAX"]


def resources(split: int, warps: int, mode: int, stages: int = 0, size_hint: bool = True) -> dict:
    """size_hint=False: the row-tile count without the divisibility specialization, as a compiled caller
    of dynamic length (inductor, symbolic M) launches it."""
    consts = {"BLOCK": 128, "SPLIT": split, "MODE": mode, "COLS": True, "STORE_X": False, "STAGES": stages,
              "EPS": TORCHAO_EPS, "FP8_MAX": FP8_MAX}
    hinted = [i for i, name in enumerate(ARGS) if size_hint or name != "MT"]
    src = ASTSource(fn=kernels._quant_dual_kernel, signature=ARGS | dict.fromkeys(CONSTEXPRS, "constexpr"),
                    constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in hinted})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+([A-Z0-9_.]+)", sass, re.M)
    return {"registers": int(regs), "stack_bytes": int(stack), "shared_bytes": compiled.metadata.shared,
            "instructions": sum(not op.startswith("NOP") for op in ops),
            "byte_stores": sum(op.startswith("STG") and ".U8" in op for op in ops)}  # unvectorized FP8 stores


def main(argv: list[str]) -> None:
    swiglu = kernels.DEFAULT_SWIGLU_CONFIG[:2]
    launches = [tuple(int(v) for v in a.split(",")) for a in argv] or [
        (*kernels.DEFAULT_CONFIG[:2], 0), (*swiglu, 1), (*swiglu, 2)]
    for launch in launches:
        if len(launch) not in (3, 4):
            sys.exit(f"{launch}: expected split,warps,mode[,stages], e.g. 1,8,2")
        r = resources(*launch)
        print(f"split,warps,mode,stages={launch}: {r['registers']} registers, {r['stack_bytes']} B stack, "
              f"{r['shared_bytes']} B shared, {r['instructions']} SASS instructions per thread, "
              f"{resources(*launch, size_hint=False)['byte_stores']} byte stores at a dynamic length")


if __name__ == "__main__":
    main(sys.argv[1:])
