"""What a compiled program launches, read from XLA's optimized HLO text.

On a GPU target (parallel/gpu_target.py) the optimized HLO is the GPU's: library calls are custom
calls (`__cudnn$fmhaSoftmax`, `__cublas$lt$matmul$f8`, ...) and generated GEMMs are fusions whose
backend config names Triton. The planner reports these, and the `gpu_compile` tests assert on them,
because they are what a CPU compile cannot show: whether FP8 einsums became FP8 GEMMs, whether
attention became cuDNN's fused kernel.

Counts are of instructions in the program text: a scanned layer stack's body (a while loop) appears
once however many layers it runs.
"""

from __future__ import annotations

import collections
import re

FP8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
# One instruction: `%name = <result type> <opcode>(<operands>), <attributes>`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_FP8_OPERAND = re.compile(r"\b(" + "|".join(FP8_TYPES) + r")\[")
_TRITON_GEMM_KINDS = ("__triton_nested_gemm_fusion", "__triton_gemm")


def custom_calls(hlo_text: str) -> dict[str, int]:
    """Every custom-call target in the program with the number of its call sites, sorted by name."""
    counts = collections.Counter(_CUSTOM_CALL.findall(hlo_text))
    return dict(sorted(counts.items()))


def _operands(rest: str) -> str:
    """The operand list of an instruction (the text up to its closing parenthesis)."""
    depth = 1
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[:i]
    return rest


def fp8_gemms(hlo_text: str) -> dict[str, int]:
    """GEMMs whose operands are FP8: cuBLASLt calls (`cublaslt`), other library GEMM calls
    (`cublas`) and Triton GEMM fusions (`triton`), and their `total`."""
    counts = {"cublaslt": 0, "cublas": 0, "triton": 0}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        opcode, rest = match.group(2), match.group(3)
        if not _FP8_OPERAND.search(_operands(rest)):
            continue
        target = _CUSTOM_CALL.search(rest)
        if opcode == "custom-call" and target:
            name = target.group(1)
            if "cublas$lt" in name:
                counts["cublaslt"] += 1
            elif "gemm" in name or "matmul" in name:
                counts["cublas"] += 1
        elif opcode == "fusion" and any(kind in rest for kind in _TRITON_GEMM_KINDS):
            counts["triton"] += 1
    counts["total"] = sum(counts.values())
    return counts
