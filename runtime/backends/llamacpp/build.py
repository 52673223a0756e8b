"""What the backend must act on at load about the machine: the CPUs this process is given, and
what this llama.cpp build was compiled with.

See docs/models.md, "AMX".
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("mlx_actor_runtime.llamacpp")
_amx_warned = False


def amx_build(lib: Any) -> bool:
    """Whether this llama.cpp build has its AMX kernels, and so takes AMX's extra buffer type for
    weights when extra buffer types are on. On Sapphire Rapids those kernels segfault in
    ``ggml_backend_amx_mul_mat`` on the first pass of two rows or more (llama.cpp #20824, also
    why Ollama ships no AMX build), so the backend then gives up extra buffer types (the x86
    repacked kernels with them: slower on Q4_K) and warns once: build llama-cpp-python without
    AMX (the Makefile's ``LLAMA_CMAKE_ARGS``, docs/models.md) to keep them."""
    global _amx_warned
    info = lib.llama_print_system_info().decode("utf-8", "replace")
    if "AMX_INT8 = 1" not in info:
        return False
    if not _amx_warned:
        _amx_warned = True
        log.warning(
            "this llama-cpp-python was built with AMX kernels, which crash on some CPUs "
            "(llama.cpp #20824): weights stay unrepacked (slower); rebuild it with "
            "CMAKE_ARGS='-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-int8 "
            "-DCMAKE_CXX_FLAGS=-mno-amx-int8' (docs/models.md)"
        )
    return True


def cpus_given() -> int:
    """The threads a computation of this process should use: ``$OMP_NUM_THREADS`` where set (Ray
    sets it to an engine's CPUs, so engines sharing a node do not run more threads than it has
    cores; OpenBLAS, MLX's CPU matmuls, follows it too), else every CPU it may run on."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    may_run_on = len(os.sched_getaffinity(0))
    return min(int(given), may_run_on) if given.isdigit() and int(given) > 0 else may_run_on
