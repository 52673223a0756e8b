"""Hide AMX from llama.cpp in this process: ``PYTHONPATH=scripts/no_amx:. python ...``.

A ``GGML_NATIVE=ON`` build of llama.cpp on an AMX CPU puts quantized weights in its AMX buffer
type, whose ``ggml_backend_amx_mul_mat`` segfaults on the first pass of 2+ rows (llama.cpp #20824;
docs/models.md, Install). ggml enables AMX only once ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`` succeeds, so a seccomp filter that fails that one call (EPERM) makes ggml
find no AMX and repack the weights as on a CPU without it. Imported by Python at start-up (as
``sitecustomize``) before any thread exists, so every thread inherits the filter. A workaround for
measuring and testing on such a machine, not part of the runtime.
"""

import ctypes
import struct

_ARCH_PRCTL = 158  # x86_64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_AUDIT_ARCH_X86_64 = 0xC000003E


def _instruction(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def _install() -> None:
    load, jump_eq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET
    program = b"".join(
        [
            _instruction(load, 0, 0, 4),  # seccomp_data.arch
            _instruction(jump_eq, 0, 5, _AUDIT_ARCH_X86_64),
            _instruction(load, 0, 0, 0),  # seccomp_data.nr
            _instruction(jump_eq, 0, 3, _ARCH_PRCTL),
            _instruction(load, 0, 0, 16),  # the low half of args[0]
            _instruction(jump_eq, 0, 1, _ARCH_REQ_XCOMP_PERM),
            _instruction(ret, 0, 0, 0x00050000 | 1),  # SECCOMP_RET_ERRNO | EPERM
            _instruction(ret, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
        ]
    )
    buffer = ctypes.create_string_buffer(program)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    filter_ = Program(len(program) // 8, ctypes.addressof(buffer))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, needed without CAP_SYS_ADMIN
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(22, 2, ctypes.byref(filter_), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


_install()
