"""The disk tier's protocol on the simulator (docs/protocols.md, "Disk tier").

Hypothesis draws a program of generates (prompts over a tiny alphabet, so they share prefixes),
restarts (an unload and a load: RAM empty, the disk's files kept), resets and damaged files, on a
trimmable or a checkpointing simulated model under a KV budget that forces evictions. After every
generate:

* greedy output equals the oracle (``greedy_continuation``): a state read back from disk never
  changes what the model says, whatever was evicted, restarted or damaged;
* ``Started`` is honest: ``tier`` is ``disk`` only with cached tokens, ``cold`` only without,
  at most all but one prompt token reused, and only tokens some earlier sequence computed
  since the last reset;
* only the rest of the prompt is prefilled (the engine's ``prefilled_tokens``);
* the disk's files stay within their byte budget, and KV bytes are conserved.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import event, given, settings
from hypothesis import strategies as st

from runtime.backends.disk import DiskCacheConfig
from runtime.backends.simulated import greedy_continuation
from runtime.messages import (
    Finished,
    LoadModel,
    ModelLoaded,
    ResetPrefixes,
    ReuseTier,
    Started,
    UnloadModel,
)
from runtime.testing.harness import engine, kv_keeper, make_sim, prefix_cache, sim_spec
from runtime.testing.requests import generate

MAX_TOKENS = 3
BPT = 100
DISK_BUDGET = 40 * BPT * 2  # a few entries' files (each token: two int64/uint64 values)

prompts = st.lists(st.integers(0, 2), min_size=2, max_size=24).map(tuple)
steps = st.lists(
    st.one_of(
        prompts.map(lambda p: ("generate", p)),
        st.just(("restart", ())),
        st.just(("damage", ())),
        st.just(("reset", ())),
    ),
    min_size=1,
    max_size=14,
)


def _damage(root: Path) -> None:
    for path in sorted(root.rglob("*.safetensors"))[:1]:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x5A
        path.write_bytes(bytes(data))


@settings(max_examples=60, deadline=None)
@given(program=steps, trimmable=st.booleans())
def test_a_disk_hit_never_changes_output_and_started_says_where_it_came_from(
    program: list[tuple[str, tuple[int, ...]]], trimmable: bool
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        spec = sim_spec(
            chunk=4,
            bytes_per_token=BPT,
            trimmable=trimmable,
            fixed_state_bytes=0 if trimmable else 3 * BPT,
            checkpoint_every_tokens=64,
        )
        config = DiskCacheConfig(directory=directory, budget_bytes=DISK_BUDGET)
        # Room for about one request's KV: each new prompt evicts what the last one left.
        sim = make_sim(spec, budget=60 * BPT, disk_cache=config)
        computed: set[tuple[int, ...]] = set()  # every prefix some sequence's cache held
        for index, (step, prompt) in enumerate(program):
            if step == "restart":
                sim.ask(UnloadModel(model="m"))
                assert isinstance(sim.ask(LoadModel(spec=spec)), ModelLoaded)
                continue
            if step == "damage":
                _damage(root)
                continue
            if step == "reset":  # nothing computed before it may be reused, from RAM or disk
                sim.ask(ResetPrefixes(model="m"))
                computed.clear()
                continue
            core = engine(sim)
            before = core.counters.snapshot().get("prefilled_tokens", 0)
            sim.send(generate(f"r{index}", prompt, MAX_TOKENS))  # fmt: skip
            sim.run_until_quiescent()
            events = sim.events(f"r{index}", 1)
            [started] = [e for e in events if isinstance(e, Started)]
            assert isinstance(events[-1], Finished), events[-1]
            output = sim.emitted_tokens(f"r{index}", 1)
            assert output == greedy_continuation(prompt, MAX_TOKENS)
            cached = started.cached_tokens
            event(f"tier {started.tier}")
            assert (started.tier is ReuseTier.COLD) == (cached == 0)
            assert cached <= len(prompt) - 1
            assert cached == 0 or prompt[:cached] in computed
            prefilled = core.counters.snapshot().get("prefilled_tokens", 0) - before
            assert prefilled == len(prompt) - cached
            full = prompt + tuple(output)
            computed.update(full[:n] for n in range(1, len(full) + 1))
            files = sum(p.stat().st_size for p in root.rglob("*.safetensors"))
            assert files <= DISK_BUDGET
            assert prefix_cache(sim).total_bytes <= kv_keeper(sim).reserved_bytes


entries = st.lists(
    st.tuples(
        st.lists(st.integers(0, 2), min_size=1, max_size=12).map(tuple),
        st.booleans(),
        st.sets(st.integers(1, 11), max_size=3),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=80, deadline=None)
@given(stored=entries, prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14).map(tuple))
def test_the_store_matches_a_prompt_as_the_prefix_cache_would(
    stored: list[tuple[tuple[int, ...], bool, set[int]]], prompt: tuple[int, ...]
) -> None:
    """``DiskStore.best`` against a naive model: a trimmable file serves its longest common
    prefix with the prompt, another only whole or at a point that prefixes it; at most all but
    the last prompt token, the longest wins."""
    import numpy as np

    from runtime.backends.disk import DiskStore, HostState

    with tempfile.TemporaryDirectory() as directory:
        store = DiskStore(Path(directory), "f" * 64, 1 << 30)
        model: dict[tuple[int, ...], tuple[bool, tuple[int, ...]]] = {}  # the last write wins
        for tokens, trimmable, points in stored:
            kept = () if trimmable else tuple(sorted(p for p in points if p < len(tokens)))
            host = HostState(len(tokens), "{}", {"x": np.zeros(1, np.float32)}, kept)
            store.write("n", tokens, trimmable, host)
            model[tokens] = (trimmable, kept)
        expected = 0
        for tokens, (trimmable, kept) in model.items():
            limit = len(prompt) - 1
            if trimmable:
                n = 0
                while n < min(len(tokens), limit) and tokens[n] == prompt[n]:
                    n += 1
            else:
                usable = [p for p in (*kept, len(tokens)) if p <= limit]
                n = max((p for p in usable if tokens[:p] == prompt[:p]), default=0)
            expected = max(expected, n)
        found = store.best("n", prompt)
        assert (0 if found is None else found.matched) == expected
        assert store.best("other", prompt) is None
