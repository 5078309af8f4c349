"""What a compiled program launches, read from XLA's optimized HLO text.

On a GPU target (parallel/compile_targets/gpu.py) the optimized HLO is the GPU's: library calls are
custom calls (`__cudnn$fmhaSoftmax`, `__cublas$lt$matmul$f8`, ...) and generated GEMMs are fusions
whose backend config names Triton. The planner reports these, and the `gpu_compile` tests assert on
them, because they are what a CPU compile cannot show: whether FP8 einsums became FP8 GEMMs, whether
attention became cuDNN's fused kernel.

On a TPU target (parallel/compile_targets/tpu.py) a Pallas kernel, compiled by Mosaic, is a
`tpu_custom_call`; every kernel has that one target, so `custom_calls` names each by its kernel
(`tpu_custom_call:splash_mha_fwd_segmented_residuals`), from the call's `op_name` metadata (the
Pallas call's name) or else the instruction's own name. The TPU compiler's other custom calls
(`AssumeGatherIndicesInBound`, `ConcatBitcast`, ...) are its own helpers, counted as they are.

Counts are of instructions in the program text: a scanned layer stack's body (a while loop) appears
once however many layers it runs.
"""

from __future__ import annotations

import collections
import dataclasses
import re

FP8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
MOSAIC_CALL = "tpu_custom_call"  # a Pallas kernel on a TPU (Mosaic)
_OP_NAME = re.compile(r'\bop_name="([^"]+)"')
# One instruction: `%name = <result type> <opcode>(<operands>), <attributes>`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
# A computation's first line: `%name (<parameters>) -> <type> {` (or `ENTRY %name ...`)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_OPERAND_NAME = re.compile(r"%([\w.\-]+)")
_FP8_TYPE = re.compile(r"^\(?(" + "|".join(FP8_TYPES) + r")\[")
_FP8_OPERAND = re.compile(r"\b(" + "|".join(FP8_TYPES) + r")\[")
_TRITON_GEMM_KINDS = ("__triton_nested_gemm_fusion", "__triton_gemm")


def custom_calls(hlo_text: str) -> dict[str, int]:
    """Every custom-call target in the program with the number of its call sites, sorted by name;
    a TPU Pallas kernel as `tpu_custom_call:<kernel>` (module docstring)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in hlo_text.splitlines():
        for target in _CUSTOM_CALL.findall(line):
            counts[f"{target}:{_mosaic_kernel(line)}" if target == MOSAIC_CALL else target] += 1
    return dict(sorted(counts.items()))


def _mosaic_kernel(line: str) -> str:
    """The kernel a `tpu_custom_call` instruction runs: the Pallas call's name in its op_name
    (`.../splash_mha_fwd/pallas_call`), else the instruction's name less XLA's `.N` suffix."""
    op_name = _OP_NAME.search(line)
    if op_name:
        parts = op_name.group(1).split("/")
        if len(parts) > 1 and parts[-1] == "pallas_call":
            return parts[-2]
    instruction = _INSTRUCTION.match(line)
    return re.sub(r"\.\d+$", "", instruction.group(1)) if instruction else "unnamed"


def _operands(rest: str) -> str:
    """The operand list of an instruction (the text up to its closing parenthesis)."""
    depth = 1
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[:i]
    return rest


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Instruction:
    computation: str
    result_type: str
    opcode: str
    operands: str
    rest: str


def _instructions(hlo_text: str) -> tuple[list[_Instruction], dict[tuple[str, str], str]]:
    """Every instruction of the module (with the computation it is in), and the result type of
    each (computation, instruction name)."""
    found, types, computation = [], {}, ""
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            header = _COMPUTATION.match(line)
            computation = header.group(1) if header else computation
            continue
        name, result_type, opcode, rest = match.groups()
        found.append(_Instruction(computation=computation, result_type=result_type, opcode=opcode,
                                  operands=_operands(rest), rest=rest))
        types[(computation, name)] = result_type
    return found, types


def _has_fp8_operand(instruction: _Instruction, types: dict[tuple[str, str], str]) -> bool:
    """Whether an operand is FP8: typed in the operand list (older HLO text prints
    `f8e4m3fn[...] %x`), or named there and defined with an FP8 type (newer text prints `%x`)."""
    if _FP8_OPERAND.search(instruction.operands):
        return True
    return any(_FP8_TYPE.match(types.get((instruction.computation, name), ""))
               for name in _OPERAND_NAME.findall(instruction.operands))


def fp8_gemms(hlo_text: str) -> dict[str, int]:
    """GEMMs whose operands are FP8: cuBLASLt calls (`cublaslt`), other library GEMM calls
    (`cublas`) and Triton GEMM fusions whose dot takes FP8 operands (`triton`), and their `total`.

    A fusion's FP8 parameters alone do not make an FP8 GEMM (it may convert them to BF16 before
    its dot), so a Triton fusion counts when the dot inside it reads FP8 values."""
    instructions, types = _instructions(hlo_text)
    fp8_dot_computations = {i.computation for i in instructions
                            if i.opcode == "dot" and _has_fp8_operand(i, types)}
    counts = {"cublaslt": 0, "cublas": 0, "triton": 0}
    for instruction in instructions:
        if instruction.opcode == "custom-call" and _has_fp8_operand(instruction, types):
            target = _CUSTOM_CALL.search(instruction.rest)
            name = target.group(1) if target else ""
            if "cublas$lt" in name:
                counts["cublaslt"] += 1
            elif "gemm" in name or "matmul" in name:
                counts["cublas"] += 1
        elif instruction.opcode == "fusion" and any(kind in instruction.rest
                                                    for kind in _TRITON_GEMM_KINDS):
            called = _CALLS.search(instruction.rest)
            if called and called.group(1) in fp8_dot_computations:
                counts["triton"] += 1
    counts["total"] = sum(counts.values())
    return counts


def _operand_types(instruction: _Instruction, types: dict[tuple[str, str], str]) -> tuple[str, ...]:
    """The element type of each operand ("f8e4m3fn", "bf16", ...), typed in place or by
    definition."""
    typed = re.findall(r"\b([a-z]\w*)\[[^\]]*\](?:\{[^}]*\})?\s+%", instruction.operands)
    if typed:
        return tuple(typed)
    return tuple(types.get((instruction.computation, name), "").lstrip("(").split("[", 1)[0]
                 for name in _OPERAND_NAME.findall(instruction.operands))


def cublaslt_fp8_operand_types(hlo_text: str) -> list[tuple[str, str]]:
    """The (lhs, rhs) element types of each cuBLASLt FP8 GEMM: a forward pass multiplies e4m3 by
    e4m3, the backward pass's gradient GEMMs take an e5m2 operand."""
    instructions, types = _instructions(hlo_text)
    found = []
    for instruction in instructions:
        target = _CUSTOM_CALL.search(instruction.rest)
        if instruction.opcode == "custom-call" and target and "cublas$lt" in target.group(1):
            operands = _operand_types(instruction, types)
            if len(operands) >= 2 and any(t in FP8_TYPES for t in operands[:2]):
                found.append((operands[0], operands[1]))
    return found
