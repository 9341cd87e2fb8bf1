"""A classic BPF interpreter for seccomp programs, as the kernel runs them (tests only).

It knows every instruction the kernel's seccomp checker accepts (``seccomp_check_filter``:
loads of ``seccomp_data`` words, the ALU, jumps, returns, the scratch memory and the X
register) and refuses anything else, so a program it runs is one the kernel would load.
It also checks what the kernel's loader checks: at most 4096 instructions, every jump
forward and inside the program, a return as the last instruction.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

MAX_INSNS = 4096
_SECCOMP_DATA_SIZE = 64


class BadProgram(ValueError):
    """The kernel would refuse this program."""


def decode(program: bytes) -> list[tuple[int, int, int, int]]:
    """``(code, jt, jf, k)`` per instruction, after the loader's structural checks."""
    if len(program) % 8 or not program:
        raise BadProgram("length is not a positive multiple of 8")
    insns = [struct.unpack_from("=HBBI", program, off) for off in range(0, len(program), 8)]
    if len(insns) > MAX_INSNS:
        raise BadProgram(f"{len(insns)} instructions (max {MAX_INSNS})")
    for pc, (code, jt, jf, k) in enumerate(insns):
        cls = code & 0x07
        if cls == 0x05:  # BPF_JMP
            targets = [pc + 1 + k] if code == 0x05 else [pc + 1 + jt, pc + 1 + jf]
            if any(t >= len(insns) for t in targets):
                raise BadProgram(f"jump out of the program at {pc}")
        elif cls == 0x00 and code == 0x20 and (k % 4 or k >= _SECCOMP_DATA_SIZE):
            raise BadProgram(f"misaligned or out-of-range load at {pc}: {k}")
    if insns[-1][0] & 0x07 != 0x06:
        raise BadProgram("the last instruction is not a return")
    return insns


def seccomp_data(nr: int, arch: int, args: Sequence[int] = (), ip: int = 0) -> bytes:
    """``struct seccomp_data`` in native byte order; arguments are 64-bit."""
    full = [*args, *[0] * (6 - len(args))]
    return struct.pack("=iIQ6Q", nr, arch, ip, *(a & (2**64 - 1) for a in full))


def _alu(op: int, a: int, src: int) -> int:
    if op == 0x00:
        return a + src
    if op == 0x10:
        return a - src
    if op == 0x20:
        return a * src
    if op == 0x30:
        return a // src
    if op == 0x40:
        return a | src
    if op == 0x50:
        return a & src
    if op == 0x60:
        return a << src
    if op == 0x70:
        return a >> src
    if op == 0x80:
        return -a
    if op == 0x90:
        return a % src
    if op == 0xA0:
        return a ^ src
    raise BadProgram(f"unknown ALU op {op:#x}")


def run(program: bytes, data: bytes) -> int:
    """The action the program returns for `data` (a ``SECCOMP_RET_*`` value)."""
    return trace(program, data)[0]


def trace(program: bytes, data: bytes) -> tuple[int, int]:
    """The action, and how many instructions ran to reach it."""
    insns = decode(program)
    steps = 0
    a = x = 0
    mem = [0] * 16
    pc = 0
    mask = 0xFFFFFFFF
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        steps += 1
        cls = code & 0x07
        if cls == 0x06:  # RET
            return (k if code == 0x06 else a), steps
        if code == 0x20:  # LD W ABS
            a = struct.unpack_from("=I", data, k)[0]
        elif code == 0x00:  # LD IMM
            a = k
        elif code == 0x80:  # LD W LEN
            a = _SECCOMP_DATA_SIZE
        elif code == 0x60:  # LD MEM
            a = mem[k]
        elif code == 0x01:  # LDX IMM
            x = k
        elif code == 0x81:  # LDX W LEN
            x = _SECCOMP_DATA_SIZE
        elif code == 0x61:  # LDX MEM
            x = mem[k]
        elif code == 0x02:  # ST
            mem[k] = a
        elif code == 0x03:  # STX
            mem[k] = x
        elif code == 0x07:  # TAX
            x = a
        elif code == 0x87:  # TXA
            a = x
        elif cls == 0x04:  # ALU
            op, src = code & 0xF0, (x if code & 0x08 else k)
            a = _alu(op, a, src) & mask
        elif cls == 0x05:  # JMP
            op, src = code & 0xF0, (x if code & 0x08 else k)
            if op == 0x00:
                pc += k
                continue
            taken = {0x10: a == src, 0x20: a > src, 0x30: a >= src, 0x40: bool(a & src)}
            if op not in taken:
                raise BadProgram(f"unknown jump {code:#x}")
            pc += jt if taken[op] else jf
        else:
            raise BadProgram(f"instruction the seccomp checker refuses: {code:#x}")
