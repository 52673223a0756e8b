"""The disk tier on the llama.cpp backend (runtime/backends/llamacpp/persist.py).

After an unload writes the model's entries (each state's ``llama_state_seq_get_data`` bytes and
its points' partial bytes) and a new load finds them, a longer prompt is served from disk: the
same tokens reused as a RAM hit of the same prompt would reuse, only the rest prefilled, and the
output equal to that RAM hit's and to a cold run's. Real SmolLM2 (``trim``: the whole first
prompt) and Gemma 3 (``checkpoint``: its sliding window restored from a point's partial state),
both with ``exact_reuse``; and the tiny recurrent (``mamba``) and hybrid sliding-window
(``lfm2-swa``) GGUFs, whose every reuse restores a point's partial state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runtime.backends.disk import DiskCacheConfig, HostState
from runtime.backends.llamacpp import persist
from runtime.backends.llamacpp.tokenizer import load_tokenizer, tokenizer_dir
from runtime.backends.model_source import converted_models_dir
from runtime.host.api import Completion, Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, ReusePath, ReuseTier
from runtime.testing.arch_harness import prompt_tokens
from runtime.testing.harness import engine_stats
from tests.loop_checks import LoopBackend, on_asyncio
from tests.test_real_model_reuse import CORPUS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900)]

MAX_TOKENS = 6
BUDGET = 4 << 30
REAL = ("smollm2-135m-instruct", "gemma3-270m")
TINY = ("mamba", "lfm2-swa")


@pytest.fixture
def anyio_backend() -> LoopBackend:
    return on_asyncio()  # one event loop kind: these runs are long


@dataclass
class Outcome:
    cold: Completion
    ram: Completion
    disk: Completion
    prefilled: int
    disk_hits: int


async def cold_ram_and_disk(
    spec: ModelSpec, base: list[int], longer: list[int], folder: Path
) -> Outcome:
    """``longer`` cold; after ``base``, as a RAM hit; and after ``base`` then an unload and a new
    load with the disk tier on, as a disk hit (its prefilled tokens and disk hits counted)."""
    async with Runtime(RuntimeConfig(kv_budget_bytes=BUDGET)) as rt:
        await rt.load_model(spec)
        cold = await rt.complete(spec.name, prompt_tokens=longer, max_tokens=MAX_TOKENS)
        await rt.reset(spec.name)  # forget it: the next ``longer`` reuses ``base`` only
        await rt.complete(spec.name, prompt_tokens=base, max_tokens=MAX_TOKENS)
        ram = await rt.complete(spec.name, prompt_tokens=longer, max_tokens=MAX_TOKENS)
    disk = DiskCacheConfig(directory=str(folder))
    async with Runtime(RuntimeConfig(kv_budget_bytes=BUDGET, disk_cache=disk)) as rt:
        await rt.load_model(spec)
        await rt.complete(spec.name, prompt_tokens=base, max_tokens=MAX_TOKENS)
        await rt.unload_model(spec.name)  # writes what RAM holds
        loaded = await rt.load_model(spec)  # RAM empty; the disk's index read at load
        hit = await rt.complete(spec.name, prompt_tokens=longer, max_tokens=MAX_TOKENS)
        stats = engine_stats(rt, loaded)
    return Outcome(
        cold, ram, hit, stats.counters["prefilled_tokens"], stats.counters.get("disk_hits", 0)
    )


def check(outcome: Outcome, longer: list[int], path: ReusePath) -> None:
    """The disk hit reuses what the RAM hit did, prefills only the rest and answers alike."""
    ram, hit = outcome.ram.started, outcome.disk.started
    assert ram is not None and hit is not None
    assert (ram.tier, ram.path) == (ReuseTier.RAM, path)
    assert (hit.tier, hit.path) == (ReuseTier.DISK, path)
    assert 0 < hit.cached_tokens == ram.cached_tokens < len(longer)
    assert outcome.prefilled == len(longer) - hit.cached_tokens
    assert outcome.disk_hits == 1
    assert outcome.disk.token_ids == outcome.ram.token_ids


@pytest.mark.real_model
@pytest.mark.parametrize("name", REAL)
async def test_a_disk_hit_on_real_ggufs_equals_ram_and_cold(
    name: str, tmp_path: Path, real_gguf: Callable[[str], Path]
) -> None:
    from tests.llamacpp_support import require_llama_cpp

    require_llama_cpp()
    gguf = real_gguf(name)
    tokenizer, _ = load_tokenizer(tokenizer_dir(gguf, converted_models_dir()))
    base = list(tokenizer.encode(" ".join(CORPUS[:6])))
    more = list(tokenizer.encode(" ".join(CORPUS[6:7]), add_special_tokens=False))
    longer = base + more[:60]
    # exact_reuse: a reused state's output equals a cold run's (the reuse suite's setting).
    options = {"n_threads": 1, "exact_reuse": True}
    spec = ModelSpec(name=name, path=name, backend="llamacpp", options=options)
    outcome = await cold_ram_and_disk(spec, base, longer, tmp_path)
    trims = name.startswith("smollm2")
    check(outcome, longer, ReusePath.TRIM if trims else ReusePath.CHECKPOINT)
    if trims:
        assert outcome.disk.started is not None
        assert outcome.disk.started.cached_tokens == len(base)
    if outcome.disk.token_ids != outcome.cold.token_ids and not trims:
        # Known and open (issue 22, test_real_model_reuse.py): Gemma 3's Q5_0/Q8_0 weights sum
        # by a pass's row count on llama.cpp, so reuse may draw another token at a near-tie.
        # The disk hit equals the RAM hit above, which is what the disk tier answers for.
        pytest.xfail("llama.cpp: reused != cold at a near-tie (Gemma 3)")
    assert outcome.disk.token_ids == outcome.cold.token_ids


@pytest.mark.parametrize("arch", TINY)
async def test_a_disk_hit_on_recurrent_and_hybrid_ggufs_restores_a_point(
    arch: str, tmp_path: Path, tiny_llama_gguf: Callable[[str], Path]
) -> None:
    path = tiny_llama_gguf(arch)
    options = {"n_threads": 1, "prefill_chunk_ms": 0, "checkpoint_every_tokens": 64}
    spec = ModelSpec(name=arch, path=str(path), backend="llamacpp", options=options)
    base = prompt_tokens(300, seed=26)
    longer = base + prompt_tokens(20, seed=27)
    outcome = await cold_ram_and_disk(spec, base, longer, tmp_path / "disk")
    check(outcome, longer, ReusePath.CHECKPOINT)
    assert outcome.disk.token_ids == outcome.cold.token_ids


def _child(directory: Path, gguf: Path, prompt: list[int], tmp_path: Path) -> dict[str, Any]:
    prompt_file = tmp_path / f"prompt-{len(prompt)}.json"
    prompt_file.write_text(json.dumps(prompt))
    argv = [sys.executable, "-m", "runtime.testing.disk_child", str(directory), str(gguf),
            str(prompt_file), str(MAX_TOKENS), "llamacpp"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def test_a_fresh_process_reuses_what_an_earlier_one_wrote_on_llama_cpp(
    tmp_path: Path, tiny_llama_gguf: Callable[[str], Path]
) -> None:
    """Two real processes, one after the other, on one directory (the hybrid lfm2-swa GGUF):
    the second is served from the first's files, at one of its points, and answers as cold."""
    gguf = tiny_llama_gguf("lfm2-swa")
    base = prompt_tokens(300, seed=26)
    longer = base + prompt_tokens(20, seed=27)
    async with Runtime(RuntimeConfig(kv_budget_bytes=BUDGET)) as rt:
        await rt.load_model(ModelSpec(name="m", path=str(gguf), backend="llamacpp"))
        cold = await rt.complete("m", prompt_tokens=longer, max_tokens=MAX_TOKENS)
    first = _child(tmp_path / "cache", gguf, base, tmp_path)
    second = _child(tmp_path / "cache", gguf, longer, tmp_path)
    assert (first["tier"], second["tier"]) == ("cold", "disk")
    assert 0 < second["cached_tokens"] <= len(base)
    assert second["tokens"] == list(cold.token_ids)


def test_an_exported_state_comes_back_spilled_with_its_points() -> None:
    """Importing makes no llama.cpp call: the bytes come back as a spilled state (restored into
    a seq_id at first use, on the compute thread); a point's empty partial state stays empty."""
    import numpy as np

    layout = json.dumps({"version": persist.LAYOUT_VERSION, "high_water": 40})
    arrays: dict[str, Any] = {
        persist.STATE: np.frombuffer(b"cells", dtype=np.uint8),
        "p16": np.frombuffer(b"ring", dtype=np.uint8),
    }
    state, points = persist.import_state(HostState(40, layout, arrays, (16, 32)))
    assert (state.seq, state.spilled, state.n_tokens, state.high_water) == (None, b"cells", 40, 40)
    assert {p: (s.data, s.n_tokens) for p, s in points.items()} == {
        16: (b"ring", 16),
        32: (b"", 32),
    }
    wrong = [
        (HostState(40, json.dumps({"version": 0, "high_water": 40}), arrays, ()), "version"),
        (HostState(40, layout, {}, ()), "does not fit"),
        (HostState(40, layout, arrays, (41,)), "points outside"),
        (HostState(40, layout, {persist.STATE: np.zeros(3, dtype=np.int32)}, ()), "int32"),
    ]
    for bad, why in wrong:
        with pytest.raises(ValueError, match=why):
            persist.import_state(bad)


def test_the_fingerprint_names_the_file_and_the_kernels(tmp_path: Path) -> None:
    """Another file, the same file changed, another pinned sha256 or exact_reuse (another V
    layout), another state version or fewer cells a sequence: another fingerprint."""
    import os

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF....")
    first = persist.fingerprint(gguf, None, False, 3, 4096)
    assert first == persist.fingerprint(gguf, None, False, 3, 4096)
    others = {
        persist.fingerprint(gguf, "ab" * 32, False, 3, 4096),
        persist.fingerprint(gguf, None, True, 3, 4096),
        persist.fingerprint(gguf, None, False, 4, 4096),
    }
    other = tmp_path / "n.gguf"
    other.write_bytes(b"GGUF....")
    others.add(persist.fingerprint(other, None, False, 3, 4096))
    others.add(persist.fingerprint(gguf, None, False, 3, 2048))
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    others.add(persist.fingerprint(gguf, None, False, 3, 4096))
    assert first not in others and len(others) == 6
