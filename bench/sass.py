"""Offline sm_90 compiles' SASS, shared by bench/w4_aot.py (Triton kernels) and bench/frag_aot.py (Gluon kernels):
the cubin of a compiled kernel disassembled by Triton's bundled cuobjdump, its registers and stack, and the K loop
(the longest backward-branch region)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def cubin_sass(kernel) -> tuple[int | None, int | None, list[tuple[int, str]]]:
    """(registers, stack bytes, [(address, instruction)]) of a triton.compile result; None where cuobjdump's
    resource line has no REG / STACK."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    try:
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    ops = []
    for line in sass.splitlines():
        mm = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if mm:
            ops.append((int(mm.group(1), 16), mm.group(2).strip()))
    return (int(m.group(1)), int(m.group(2)), ops) if m else (None, None, ops)


def main_loop(ops: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The longest backward-branch region of the SASS (the K loop)."""
    at = {a: i for i, (a, _) in enumerate(ops)}
    best: list[tuple[int, str]] = []
    for i, (a, t) in enumerate(ops):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = ops[at[int(m.group(1), 16)]:i + 1]
            best = body if len(body) > len(best) else best
    return best


def opcode(t: str) -> str:
    """An instruction's opcode without its predicate guard and modifiers."""
    t = re.sub(r"^@!?U?P\w+\s+", "", t)
    return t.split()[0].split(".")[0]
