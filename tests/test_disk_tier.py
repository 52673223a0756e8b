"""The disk tier through the Runtime on the real MLX backend (tiny offline models, all three
cache kinds): an evicted entry is written and served back from disk, an unload writes what RAM
holds, a fresh process reuses it; greedy output after a disk hit equals a cold run and only the
rest of the prompt is prefilled; every kind of bad file costs a recompute, never a wrong output."""

from __future__ import annotations

import json
import random
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.engine.sequence import Phase
from runtime.backends.disk import DiskCacheConfig
from runtime.backends.disk.entry_file import entry_name
from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.simulated import greedy_continuation
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancel,
    Cancelled,
    LoadModel,
    ModelLoaded,
    ModelSpec,
    ReusePath,
    ReuseTier,
    Started,
    Stats,
    UnloadModel,
)
from runtime.testing.harness import (
    engine,
    engine_stats,
    kv_keeper,
    make_sim,
    prefix_cache,
    sim_spec,
    wait_until,
)
from runtime.testing.requests import generate, prewarm
from runtime.testing.tiny_models import TinyModelKind, tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


KINDS: tuple[TinyModelKind, ...] = ("llama", "sliding", "hybrid")
CHUNK = 16
MAX_TOKENS = 6
ROOT = Path(__file__).resolve().parent.parent


def spec(kind: TinyModelKind, name: str = "m") -> ModelSpec:
    return ModelSpec(
        name=name,
        backend="mlx",
        path=str(tiny_model_path(kind)),
        prefill_chunk_tokens=CHUNK,
        options={"checkpoint_every_tokens": 32},
    )


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


BASE = tokens(200, seed=1)
NEXT = BASE + tokens(30, seed=2)  # what a later request sends: the first prompt, and more


async def cold(kind: TinyModelKind, prompt: list[int]) -> tuple[int, ...]:
    """The reference: greedy output of a model that reuses nothing (no disk tier)."""
    async with Runtime(RuntimeConfig(kv_budget_bytes=256 << 20)) as rt:
        await rt.load_model(spec(kind))
        result = await rt.complete("m", prompt_tokens=prompt, max_tokens=MAX_TOKENS)
    return result.token_ids


def disk_config(directory: Path, kv_budget_bytes: int = 256 << 20) -> RuntimeConfig:
    return RuntimeConfig(
        kv_budget_bytes=kv_budget_bytes, disk_cache=DiskCacheConfig(directory=str(directory))
    )


def counter(stats: Stats, name: str) -> int:
    return stats.counters.get(name, 0)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> TinyModelKind:
    return request.param  # type: ignore[no-any-return]


async def test_an_evicted_entry_is_written_and_served_back_from_disk(tmp_path: Path) -> None:
    """Real budget pressure on a trimmable model: the budget holds one request's KV, so the
    second request evicts the first one's entry, which the disk tier keeps."""
    reference = await cold("llama", NEXT)
    info = MlxBackend.load(spec("llama")).info
    one = info.kv_bytes(len(NEXT) + MAX_TOKENS, CHUNK)
    async with Runtime(disk_config(tmp_path, kv_budget_bytes=one * 3 // 2)) as rt:
        loaded = await rt.load_model(spec("llama"))
        await rt.complete("m", prompt_tokens=BASE, max_tokens=MAX_TOKENS)
        await rt.complete("m", prompt_tokens=tokens(200, seed=9), max_tokens=MAX_TOKENS)
        await wait_until(rt, lambda: counter(engine_stats(rt, loaded), "disk_spills") >= 1)
        before = counter(engine_stats(rt, loaded), "prefilled_tokens")
        result = await rt.complete("m", prompt_tokens=NEXT, max_tokens=MAX_TOKENS)
        stats = engine_stats(rt, loaded)
    assert result.started is not None
    assert result.started.tier is ReuseTier.DISK
    assert result.started.path is ReusePath.TRIM
    assert result.started.cached_tokens == len(BASE)
    assert counter(stats, "prefilled_tokens") - before == len(NEXT) - len(BASE)
    assert result.token_ids == reference
    assert counter(stats, "disk_hits") == 1
    assert counter(stats, "tier_disk") == 1
    assert stats.gauges["disk_entries"] >= 1


async def reload_and_run(
    rt: Runtime, kind: TinyModelKind, prompt: list[int]
) -> tuple[ModelLoaded, int, object]:
    loaded = await rt.load_model(spec(kind))
    result = await rt.complete("m", prompt_tokens=prompt, max_tokens=MAX_TOKENS)
    return loaded, counter(engine_stats(rt, loaded), "prefilled_tokens"), result


async def test_every_cache_kind_equals_cold_after_a_disk_hit(
    kind: TinyModelKind, tmp_path: Path
) -> None:
    """An unload writes the entries still in RAM; the next load of the model finds them (its
    RAM empty) and prefills only what the disk did not hold."""
    reference = await cold(kind, NEXT)
    async with Runtime(disk_config(tmp_path)) as rt:
        await rt.load_model(spec(kind))
        await rt.complete("m", prompt_tokens=BASE, max_tokens=MAX_TOKENS)
        await rt.unload_model("m")
        loaded, prefilled, result = await reload_and_run(rt, kind, NEXT)
        stats = engine_stats(rt, loaded)
    started = result.started  # type: ignore[attr-defined]
    assert started.tier is ReuseTier.DISK
    # Trimmable: the whole first prompt; a checkpoint entry cannot serve whole (its prompt and
    # reply are not all in the next prompt), so one of its points: the end of its prompt.
    assert started.cached_tokens == len(BASE)
    if kind != "llama":
        assert started.path is ReusePath.CHECKPOINT
    assert prefilled == len(NEXT) - started.cached_tokens
    assert result.token_ids == reference  # type: ignore[attr-defined]
    assert counter(stats, "disk_hits") == 1


def _entry_files(root: Path) -> list[Path]:
    return list(root.rglob("*.safetensors"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _wrong_model(path: Path) -> None:
    # As if another model's file were copied here: its header names the model that wrote it.
    ours = path.parent.name.encode()  # the folder is named by the fingerprint's start
    other = bytes(reversed(ours)) if bytes(reversed(ours)) != ours else b"0" * len(ours)
    path.write_bytes(path.read_bytes().replace(ours, other))


@pytest.mark.parametrize("damage", [_flip, _truncate, _wrong_model])
async def test_a_bad_file_costs_a_recompute_never_a_wrong_output(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    reference = await cold("llama", NEXT)
    async with Runtime(disk_config(tmp_path)) as rt:
        await rt.load_model(spec("llama"))
        await rt.complete("m", prompt_tokens=BASE, max_tokens=MAX_TOKENS)
        await rt.unload_model("m")
        files = _entry_files(tmp_path)
        assert len(files) == 1
        damage(files[0])
        loaded, prefilled, result = await reload_and_run(rt, "llama", NEXT)
        stats = engine_stats(rt, loaded)
    assert result.started.tier is ReuseTier.COLD  # type: ignore[attr-defined]
    assert prefilled == len(NEXT)
    assert result.token_ids == reference  # type: ignore[attr-defined]
    assert counter(stats, "disk_dropped") == 1
    assert not files[0].exists()


def _child(directory: Path, prompt: list[int], tmp_path: Path) -> dict[str, object]:
    prompt_file = tmp_path / f"prompt-{len(prompt)}.json"
    prompt_file.write_text(json.dumps(prompt))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "runtime.testing.disk_child",
            str(directory),
            str(tiny_model_path("hybrid")),
            str(prompt_file),
            str(MAX_TOKENS),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def test_a_fresh_process_reuses_what_an_earlier_one_wrote(tmp_path: Path) -> None:
    """Two real processes, one after the other, on one directory (a hybrid recurrent model)."""
    directory = tmp_path / "cache"
    reference = await cold("hybrid", NEXT)
    first = _child(directory, BASE, tmp_path)
    assert first["tier"] == "cold"
    second = _child(directory, NEXT, tmp_path)
    assert second["tier"] == "disk"
    assert second["cached_tokens"] == len(BASE)  # its entry's point at its prompt's end
    assert tuple(second["tokens"]) == reference  # type: ignore[arg-type]


def test_a_request_cancelled_while_its_entry_loads_ends_at_once_and_gives_everything_back(
    tmp_path: Path,
) -> None:
    """On the simulator, whose I/O jobs run after the mail before them: the request is cancelled
    while it waits in LOADING; it ends Cancelled at once, its RAM lease and KV come back, and the
    read that then runs stops at its abort flag (its reply is a counted stale dead letter)."""
    model = sim_spec(chunk=4, bytes_per_token=100)
    sim = make_sim(model, disk_cache=DiskCacheConfig(directory=str(tmp_path)))
    prompt = tuple(t % 250 for t in tokens(40, seed=5))  # the simulated vocabulary: bytes

    def send(request_id: str, sent: tuple[int, ...]) -> None:
        sim.send(generate(request_id, sent, 2))  # fmt: skip

    send("first", prompt)
    sim.run_until_quiescent()
    sim.ask(UnloadModel(model="m"))  # writes the entry
    sim.ask(LoadModel(spec=model))
    send("second", (*prompt, 7))
    sim.run_until_idle()
    while not any(s.phase is Phase.LOADING for s in engine(sim)._sequences.values()):
        assert sim.fire_next_timer(), "the request never waited for the disk"
        sim.run_until_idle()
    sim.send(Cancel(request_id="second", incarnation=1))
    sim.run_until_quiescent()
    assert isinstance(sim.terminal("second", 1), Cancelled)
    counters = engine(sim).counters.snapshot()
    assert counters["disk_loads_aborted"] == 1
    assert counters["disk_hits"] == 0
    assert sim.dead_letters["stale_disk_read"] == 1
    assert prefix_cache(sim).leased_entry_ids() == frozenset()
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes
    send("third", (*prompt, 7))  # the file is still good: the next request is served from it
    sim.run_until_quiescent()
    assert engine(sim).counters.snapshot()["disk_hits"] == 1


def test_a_full_disk_is_counted_and_never_fails_a_request(tmp_path: Path) -> None:
    """The files cannot be written (a file size limit stands in for a full disk): each write is
    a counted failure, the requests are served as without a disk tier."""
    model = sim_spec(chunk=4, bytes_per_token=100)
    sim = make_sim(model, budget=6000, disk_cache=DiskCacheConfig(directory=str(tmp_path)))
    prompts = [tuple(t % 250 for t in tokens(30, seed=s)) for s in range(4)]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        for index, prompt in enumerate(prompts):  # each evicts what the one before left
            sim.send(generate(f"r{index}", prompt, 3))  # fmt: skip
            sim.run_until_quiescent()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    for index, prompt in enumerate(prompts):
        assert sim.emitted_tokens(f"r{index}", 1) == greedy_continuation(prompt, 3)
    counters = engine(sim).counters.snapshot()
    assert counters["disk_write_failed"] >= 1
    assert counters["disk_spills"] == 0
    assert not list(tmp_path.rglob("*.safetensors"))


def test_a_prewarm_can_ask_for_its_prefix_to_be_kept_on_disk_at_once(tmp_path: Path) -> None:
    """An app's instructions prewarmed with ``keep_on_disk`` are written as soon as cached (not
    only when evicted), and stay in RAM too; a plain prewarm writes nothing yet."""
    model = sim_spec(chunk=4, bytes_per_token=100)
    sim = make_sim(model, disk_cache=DiskCacheConfig(directory=str(tmp_path)))
    plain = tuple(t % 250 for t in tokens(30, seed=7))
    kept = tuple(t % 250 for t in tokens(30, seed=8))
    for request_id, prompt, keep in (("plain", plain, False), ("kept", kept, True)):
        sim.send(prewarm(request_id, prompt, keep_on_disk=keep))  # fmt: skip
        sim.run_until_quiescent()
    counters = engine(sim).counters.snapshot()
    assert counters["disk_spills"] == 1
    assert len(_entry_files(tmp_path)) == 1
    assert engine(sim).statistics().gauges["entries"] == 2  # both still in RAM
    # The file's name is a digest of the namespace and the tokens: the kept prewarm's (all but
    # its last token: a prewarm leaves that one to the generate).
    assert _entry_files(tmp_path)[0].name == entry_name("default", kept[:-1])


def test_a_request_whose_reservation_evicts_its_own_prefix_is_served_from_the_spill(
    tmp_path: Path,
) -> None:
    """The KV budget holds one request: the next request's reservation evicts the very entry its
    lookup then wants. The entry's arrays live until written, so the disk tier serves it from
    them (before the file exists) and only the new tokens are prefilled."""
    model = sim_spec(chunk=4, bytes_per_token=100)
    sim = make_sim(model, budget=5000, disk_cache=DiskCacheConfig(directory=str(tmp_path)))
    first = tuple(t % 250 for t in tokens(30, seed=11))
    second = (*first, 1, 2, 3)
    for request_id, prompt in (("first", first), ("second", second)):
        sim.send(generate(request_id, prompt, 3))  # fmt: skip
        sim.run_until_quiescent()
    [started] = [e for e in sim.events("second", 1) if isinstance(e, Started)]
    assert (started.tier, started.cached_tokens) == (ReuseTier.DISK, len(first))
    assert sim.emitted_tokens("second", 1) == greedy_continuation(second, 3)
    counters = engine(sim).counters.snapshot()
    assert counters["disk_hits_in_flight"] == 1
    assert counters["prefilled_tokens"] == len(first) + 3
