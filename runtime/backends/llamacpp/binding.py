"""The llama.cpp calls the backend makes, through llama-cpp-python's low-level ctypes API.

One ``Context`` is one model and one llama.cpp context whose sequences (seq_ids) each have a
stream of KV cells of their own (``kv_unified`` off: below). Everything here runs on the engine's
compute thread. Errors are typed: a missing binding or a file llama.cpp cannot load is
``ModelLoadFailed`` with what to do; a failed decode is ``BackendError``; a decode the stop flag
aborted is ``PrefillInterrupted``.

A context is freed by ``close`` (the engine's close job), or else once nothing references it: an
engine whose watchdog gave up leaves its backend to the stuck thread (it cannot be closed under a
running ``llama_decode``), and the last reference goes when that thread's job ends.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from runtime.backends.contract import PrefillInterrupted
from runtime.backends.llamacpp.build import amx_build
from runtime.backends.llamacpp.passes import Row, plan_calls
from runtime.errors import BackendError, ModelLoadFailed, UnsupportedModelFormat

DEFAULT_CONTEXT = 4096  # KV cells per sequence when neither the options nor the file say less
# Flags of llama_state_seq_*_ext: only the sliding-window or recurrent part of a sequence.
PARTIAL_ONLY = 1
log = logging.getLogger("mlx_actor_runtime.llamacpp")
_recent_log: collections.deque[str] = collections.deque(maxlen=20)  # for load errors
_log_callback: Any = None  # kept referenced while llama.cpp holds it
_live = 0  # contexts made and not yet freed, in this process (``live_contexts``)
_live_lock = threading.Lock()
INSTALL_HINT = (
    "install llama-cpp-python (pip install 'mlx-actor-runtime[llamacpp]', which builds it from "
    "source in a few minutes; docs/models.md)"
)


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module; raises ``ModelLoadFailed`` saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadFailed(
            f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}"
        ) from exc
    _route_log(llama_cpp)
    return llama_cpp


def _route_log(lib: Any) -> None:
    """Send llama.cpp's log (stderr by default) to our logger at debug level, keeping the last
    lines so that a failed load can quote them."""
    global _log_callback
    if _log_callback is not None:
        return

    def forward(_level: int, text: bytes | None, _data: Any) -> None:
        line = (text or b"").decode("utf-8", "replace").rstrip()
        if line:
            _recent_log.append(line)
            log.debug("llama.cpp: %s", line)

    _log_callback = lib.llama_log_callback(forward)
    lib.llama_log_set(_log_callback, None)


def recent_log() -> str:
    """llama.cpp's last log lines that look like errors, joined (for an error message)."""
    lines = [line for line in _recent_log if "error" in line.lower() or "unknown" in line.lower()]
    return "; ".join(lines[-3:])


def live_contexts() -> int:
    """How many llama.cpp contexts this process holds now (tests check that none is leaked)."""
    return _live


def _count_live(change: int) -> None:
    global _live
    with _live_lock:
        _live += change


def _free_native(lib: Any, batch: Any, ctx: Any, model: Any) -> None:
    """Free a context's batch, context and model (once: ``Context.close`` or its finalizer)."""
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
    _count_live(-1)


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python can be imported here."""
    try:
        import_llama_cpp()
    except ModelLoadFailed:
        return False
    return True


class RowKeeper(Protocol):
    """Holds rows of the logits buffer in place (``Context.row_view``)."""

    def keep_rows(self) -> None:
        """Copy out the rows still needed: the next ``llama_decode`` overwrites them."""
        ...


class Context:
    """A loaded model and its context; ``close`` frees both."""

    def __init__(
        self,
        path: Path,
        *,
        context_length: int,
        n_batch: int,
        n_seq_max: int,
        n_threads: int,
        exact_reuse: bool = False,
    ) -> None:
        lib = import_llama_cpp()
        self._lib = lib
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        # Repacked weights (Q4_K, Q4_0 on x86) multiply 4 rows at a time and the rest one by
        # one, so a token's result would depend on its place in the pass; the plain path not.
        # Faster where the model has such weights, so only ``exact_reuse`` gives them up.
        model_params.use_extra_bufts = not exact_reuse and not amx_build(lib)
        model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not model:
            said = recent_log()
            raise UnsupportedModelFormat(
                f"llama.cpp could not load {path}"
                + (f" ({said})" if said else "")
                + ": an architecture or tensor type this llama.cpp build does not know, or a "
                "damaged file; load it with backend='mlx', or update llama-cpp-python"
            )
        self._model = model
        params = lib.llama_context_default_params()
        train = int(lib.llama_model_n_ctx_train(model))
        n_ctx = n_seq_max * (context_length or min(train or DEFAULT_CONTEXT, DEFAULT_CONTEXT))
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        # Reuse equal to a cold run, bit for bit, needs each sequence's cells laid out as a cold
        # run lays them out (a softmax or a dot product sums its lanes by cell index): so one
        # stream of cells per sequence, not the unified cache where copies share cells (measured
        # on SmolLM2: logits 0.4-0.8 apart when another sequence's cells moved this one's).
        params.kv_unified = False
        params.swa_full = False  # sliding-window layers keep their window, not the context
        # llama.cpp's own choice (auto: on for the CPU), as llama-server's: a 1,400-token prompt
        # in 512-token calls took 0.91x (SmolLM2) and 0.98x (Gemma 3) the time without it (in
        # 50-token calls 1.36x and 1.16x: the engine's lone prompts go in whole calls). Its
        # few-token passes sum differently (an 8-token pass after 200 gave other logits than
        # one 208-token pass), so not with exact_reuse.
        params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_DISABLED if exact_reuse else lib.LLAMA_FLASH_ATTN_TYPE_AUTO
        )
        params.no_perf = True
        ctx = lib.llama_init_from_model(model, params)
        if not ctx:
            lib.llama_model_free(model)
            raise ModelLoadFailed(
                f"llama.cpp could not make a context for {path} with {n_ctx} KV cells "
                f"({n_seq_max} sequences); lower context_length or max_sequences"
            )
        self._ctx = ctx
        self._memory = lib.llama_get_memory(ctx)
        self._vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.n_batch = n_batch
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(ctx))  # KV cells of one sequence
        self._batch = lib.llama_batch_init(n_batch, 0, 1)
        self._stop: threading.Event | None = None
        # Told before each ``llama_decode``, which overwrites the logits buffer: a decode batch
        # copies out the rows it handed on as token ids only (``row_view``) and may still need.
        self.row_keepers: weakref.WeakSet[RowKeeper] = weakref.WeakSet()
        self.abort_checks = 0  # times llama.cpp asked whether to stop (once per graph node)
        self._scratch: ctypes.Array[ctypes.c_uint8] = (ctypes.c_uint8 * 1)()  # copy_seq's buffer
        # Kept referenced: llama.cpp holds the pointer while the context lives.
        self._abort_cb = lib.ggml_abort_callback(self._should_abort)
        # Freed when unreachable if no one closes it (module docstring): before, a context left
        # to an abandoned thread kept its model and KV cells until the process exited. Not at
        # exit: the OS frees it then, and llama.cpp would log through Python in its teardown.
        _count_live(+1)
        self._finalizer = weakref.finalize(self, _free_native, lib, self._batch, ctx, model)
        self._finalizer.atexit = False
        self.pads_lone_rows = exact_reuse and self.lone_rows_differ()

    def lone_rows_differ(self) -> bool:
        """Whether this build computes a sequence's lone row in a pass with other kernels than
        the same row inside a longer pass (passes.py): llamafile's kernels, on in llama.cpp's
        default build, take only passes of two rows or more. Read off the build, not measured:
        the two kernels' sums agree on some contexts and not others (measured on SmolLM2:
        equal after 8, 16 or 33 tokens, 0.2-0.8 apart after 31, 32 or 256), so no short check
        at load could tell. A build with ``GGML_LLAMAFILE=OFF`` multiplies every shape alike."""
        info = self._lib.llama_print_system_info().decode("utf-8", "replace")
        return "LLAMAFILE = 1" in info

    # ------------------------------------------------------------------ facts

    def model_int(self, name: str) -> int:
        """An integer fact of the model (``n_layer``, ``n_swa``, ``n_ctx_train``...)."""
        return int(getattr(self._lib, f"llama_model_{name}")(self._model))

    def model_flag(self, name: str) -> bool:
        """A boolean fact of the model (``is_recurrent``, ``is_hybrid``)."""
        return bool(getattr(self._lib, f"llama_model_{name}")(self._model))

    def meta(self, key: str) -> str | None:
        """A metadata value of the GGUF file as text, or None."""
        buf = ctypes.create_string_buffer(256)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    # ------------------------------------------------------------------ tokens (the oracle)

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """llama.cpp's own tokenization of ``text`` (tests compare ours against it)."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        out = (ctypes.c_int32 * capacity)()
        n = self._lib.llama_tokenize(
            self._vocab, data, len(data), out, capacity, add_special, parse_special
        )
        if n < 0:
            raise BackendError(f"llama_tokenize needed {-n} tokens, more than {capacity}")
        return list(out[:n])

    # ------------------------------------------------------------------ memory

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """Remove ``seq``'s cells at positions [p0, p1) (p1 -1: to the end); False where the
        memory cannot remove part of a sequence (recurrent state)."""
        return bool(self._lib.llama_memory_seq_rm(self._memory, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Mark ``src``'s cells at positions [p0, p1) as also held by ``dst``."""
        self._lib.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        """The highest position ``seq`` holds (-1: none)."""
        return int(self._lib.llama_memory_seq_pos_max(self._memory, seq))

    def seq_size(self, seq: int, flags: int = 0) -> int:
        """Bytes ``get_seq_data`` would write for ``seq``."""
        return int(self._lib.llama_state_seq_get_size_ext(self._ctx, seq, flags))

    def get_seq_data(self, seq: int, flags: int = 0) -> bytes:
        """``seq``'s cells (all, or with ``PARTIAL_ONLY`` the sliding-window/recurrent ones)."""
        size = self._read_seq(seq, flags)
        # One memcpy: slicing a ctypes array builds a list of ints first (0.85 s for 34 MB).
        return ctypes.string_at(self._scratch, size)

    @property
    def copy_buffer_bytes(self) -> int:
        """The size of the kept host buffer that copies and spills go through."""
        return len(self._scratch)

    def grow_copy_buffer(self, size: int) -> bool:
        """Make the kept host buffer hold ``size`` bytes; whether it had to grow. To the next
        power of two, and ahead of need (``Backend.tidy``): a fresh buffer's page faults cost
        ~20 ms for a 2,000-token SmolLM2 state (46 MB), which a branch of a prompt a little
        longer than the last one paid before its first token (a copy took 25 ms, not 5.5)."""
        if len(self._scratch) >= size:
            return False
        self._scratch = (ctypes.c_uint8 * (1 << (size - 1).bit_length()))()
        ctypes.memset(self._scratch, 0, len(self._scratch))  # fault its pages in now
        return True

    def _read_seq(self, seq: int, flags: int) -> int:
        """``seq``'s cells written into the kept host buffer (grown as needed); their size."""
        size = self.seq_size(seq, flags)
        self.grow_copy_buffer(size)
        written = int(
            self._lib.llama_state_seq_get_data_ext(self._ctx, self._scratch, size, seq, flags)
        )
        if written != size:
            raise BackendError(f"llama.cpp wrote {written} of {size} bytes of a sequence state")
        return size

    def copy_seq(self, src: int, dst: int) -> bool:
        """Replace ``dst``'s cells with a copy of ``src``'s, through a host buffer kept for the
        next copy and never made into ``bytes``; False without room. Measured on a 1,800-token
        SmolLM2 state (41 MB): 41 ms through ``get_seq_data`` and ``set_seq_data`` (a fresh
        allocation's page faults and one more copy), 5 ms so (900 tokens: 21 against 2.6 ms)."""
        size = self._read_seq(src, 0)
        return bool(self._lib.llama_state_seq_set_data_ext(self._ctx, self._scratch, size, dst, 0))

    def set_seq_data(self, data: bytes, seq: int, flags: int = 0) -> bool:
        """Replace ``seq``'s cells (or its partial ones) with ``data``; False without room."""
        # llama.cpp only reads it: a pointer into the bytes themselves, no copy.
        src = ctypes.cast(ctypes.c_char_p(data or b"\0"), ctypes.POINTER(ctypes.c_uint8))
        return bool(self._lib.llama_state_seq_set_data_ext(self._ctx, src, len(data), seq, flags))

    # ------------------------------------------------------------------ compute

    def decode(self, rows: Sequence[Row], stop: threading.Event | None = None) -> list[mx.array]:
        """``rows`` (at most ``n_batch``) through ``llama_decode``; the float32 logits of each
        row that asks for them, in order, as the ``mx.array``s the samplers take. With ``stop``
        a call gives up between graph nodes once it is set (``PrefillInterrupted``; llama.cpp
        drops what that call added).

        Where a sequence's lone row would be computed by other kernels than the same row inside
        a longer pass (``pads_lone_rows``), the rows go in calls planned by ``passes.plan_calls``
        (a throwaway row beside each lone one, equal rows per sequence)."""
        calls = plan_calls(rows, self.n_batch, pad=self.pads_lone_rows)
        kept: dict[int, mx.array] = {}
        for call in calls:
            try:
                self._decode_call(call.rows, stop)
                for at, index in call.logits_at:
                    kept[index] = self._logits(at)
            finally:  # also after a failed or interrupted call (then there is nothing to drop)
                for seq, pos in call.padded:
                    self.seq_rm(seq, pos, -1)
        return [kept[i] for i in sorted(kept)]

    def decode_in_place(self, rows: Sequence[Row]) -> list[int] | None:
        """``rows`` (at most ``n_batch``) through one ``llama_decode``, their logits left in
        place: for each row that keeps logits, in order, its index for ``row_view``. None
        (nothing run) where the rows take more than one call (``plan_calls``): then ``decode``."""
        calls = plan_calls(rows, self.n_batch, pad=self.pads_lone_rows)
        if len(calls) != 1:
            return None
        (call,) = calls
        try:
            self._decode_call(call.rows, None)
        finally:
            for seq, pos in call.padded:  # removing cells leaves the logits buffer as it is
                self.seq_rm(seq, pos, -1)
        return [at for at, _ in call.logits_at]

    def _decode_call(self, rows: Sequence[Row], stop: threading.Event | None) -> None:
        for keeper in list(self.row_keepers):
            keeper.keep_rows()
        batch = self._batch
        for i, row in enumerate(rows):
            batch.token[i] = row.token
            batch.pos[i] = row.pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = row.seq
            batch.logits[i] = row.logits
        batch.n_tokens = len(rows)
        if stop is not None:
            self._stop = stop
            self._lib.llama_set_abort_callback(self._ctx, self._abort_cb, None)
        try:
            rc = int(self._lib.llama_decode(self._ctx, batch))
        finally:
            if stop is not None:
                self._lib.llama_set_abort_callback(self._ctx, self._lib.ggml_abort_callback(), None)
                self._stop = None
        if rc == 2:
            raise PrefillInterrupted("the sequence was aborted during this llama_decode")
        if rc != 0:
            why = "no room in its KV cache" if rc == 1 else f"error {rc}"
            raise BackendError(
                f"llama_decode of {len(rows)} tokens failed: {why}; load the model with a "
                "larger context_length"
            )

    def _logits(self, i: int) -> mx.array:
        """Row ``i``'s logits copied once, from the buffer the next ``llama_decode`` overwrites
        straight into MLX's memory (``mx.array`` copies what it is made from): not into numpy
        first and again into MLX, which cost a step another vocabulary-sized copy."""
        return mx.array(self.row_view(i))

    def row_view(self, i: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Row ``i`` of the last call's logits, in place: valid until the next ``llama_decode``
        (which tells ``row_keepers`` first). A greedy row's argmax reads it without a copy
        (Gemma 3's 262k-token row is 1 MB: 53 us to copy into MLX, 15 us to argmax)."""
        ptr = self._lib.llama_get_logits_ith(self._ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _should_abort(self, _data: Any) -> bool:
        self.abort_checks += 1
        stop = self._stop
        return stop is not None and stop.is_set()

    def close(self) -> None:
        """Free the batch, the context and the model (idempotent)."""
        free = getattr(self, "_finalizer", None)
        if free is not None:
            free()  # a finalizer runs once: a second close, or collection after it, does nothing
        self._ctx = None
