"""The disk group's peers: the same 2,000-token prompt through mlx-lm's prompt cache file and
through llama-server's slot save/restore, each a fresh process after the file is written.

Neither is automatic: the host decides when to save, names each file, and restores it by name
before sending the prompt (ours spills evicted entries and finds them by their tokens). Both are
measured the way ``bench/disk.py`` measures ours, so the rows are comparable: a first process
prefills the prompt cold and writes the file; a second, fresh one restores it and answers the same
prompt; time to first token from the restore's start (the model already loaded). Where the
restored answer's first token is not the cold one's, the hit row's note says so. Rows (systems
``mlx-lm`` and ``llama-server``): ``disk.cold_ttft``, ``disk.hit_ttft``, ``disk.hit/cold``,
``disk.cached_tokens``.

- ``mlx-lm``: what ``mlx_lm.cache_prompt`` does (``generate_step`` with ``max_tokens=0`` over all
  but the prompt's last token, then ``save_prompt_cache``), after a cold ``generate_step`` of the
  whole prompt timed to its first token; the fresh process times ``load_prompt_cache`` and
  ``generate_step`` of the last token to its first token.
- ``llama-server``: ``--parallel 1 --swa-full --slot-save-path DIR``; the first server answers
  the prompt (``n_predict: 1``) cold and saves slot 0 (``POST /slots/0?action=save``); a second
  server restores it (``action=restore``) and answers the same prompt; the hit's TTFT is the
  restore plus that answer. ``disk.cached_tokens`` is the prompt less what its
  ``timings.prompt_n`` says it evaluated. Real models only (it needs their GGUF file).
  ``--swa-full`` (no effect without a sliding window) keeps Gemma 3's sliding layers whole: at
  its defaults llama-server re-processed all 2,000 tokens after restoring the slot
  (``timings.prompt_n``), so the row would measure no restore at all.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import llamacpp
from bench.disk import PROMPT_TOKENS, ROOT, ROUNDS
from bench.http_client import Server, post_json
from bench.models import BenchModel
from bench.prompts import encode, make_text
from bench.results import Measurement, ratio, timed
from bench.serving import ServerCommand, running

MLX_LM = "mlx-lm"
CONTEXT = 4096  # llama-server's context: the prompt and its answer, not the model's 8k/32k


def prompt_for(model: BenchModel, quick: bool) -> list[int]:
    """The disk group's prompt (``bench/disk.py``'s, token for token)."""
    n = PROMPT_TOKENS.pick(model, quick)
    return encode(model.tokenizer, make_text(model.tokenizer, n, seed=26))[:n]


def rows(
    system: str,
    model: str,
    cold: list[float],
    hit: list[float],
    cached: list[float],
    differed: list[str],
) -> list[Measurement]:
    """The four rows; ``differed`` says, per round, where the restored answer's first token was
    not the cold one's (a note on the hit row: that peer's restore is not exact)."""
    cold_m = timed(system, model, "disk.cold_ttft", cold, unit="s")
    hit_m = timed(system, model, "disk.hit_ttft", hit, unit="s")
    if differed:
        hit_m = replace(hit_m, note="first token after the restore != cold: " + "; ".join(differed))
    return [
        cold_m,
        hit_m,
        ratio(system, model, "disk.hit/cold", hit_m.value, cold_m.value),
        Measurement(system, model, "disk.cached_tokens", max(cached), "tokens", cached),
    ]


def mlx_lm_file(model: BenchModel, quick: bool) -> list[Measurement]:
    """mlx-lm's prompt cache file: cold and save in one process, restore in a fresh one."""
    prompt = prompt_for(model, quick)
    cold, hit, cached, differed = [], [], [], []
    for _ in range(ROUNDS.pick(model, quick)):
        with tempfile.TemporaryDirectory() as folder:
            prompt_file = Path(folder) / "prompt.json"
            prompt_file.write_text(json.dumps(prompt))
            cache_file = Path(folder) / "prompt.safetensors"
            first = _mlx_child("save", model.path, prompt_file, cache_file)
            second = _mlx_child("restore", model.path, prompt_file, cache_file)
            if first["token"] != second["token"]:
                differed.append(f"{second['token']} vs {first['token']}")
            cold.append(first["ttft_s"])
            hit.append(second["ttft_s"])
            cached.append(float(len(prompt) - 1))
    return rows(MLX_LM, model.name, cold, hit, cached, differed)


def _mlx_child(step: str, model_path: Path, prompt_file: Path, cache_file: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.disk_peers", step, str(model_path), str(prompt_file),
            str(cache_file)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, timeout=1800)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _mlx_main(step: str, model_path: str, prompt_json: str, cache_path: str) -> dict[str, Any]:
    """One process of ``mlx_lm_file``: ``save`` (cold TTFT, then the file) or ``restore``."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    model, _ = load(model_path)
    prompt = [int(t) for t in json.loads(Path(prompt_json).read_text())]
    began = time.perf_counter()
    if step == "save":
        cache = make_prompt_cache(model)
        token, _ = next(generate_step(mx.array(prompt), model, max_tokens=1, prompt_cache=cache))
        ttft = time.perf_counter() - began
        cache = make_prompt_cache(model)  # mlx_lm.cache_prompt: all but the last token
        for _ in generate_step(mx.array(prompt[:-1]), model, max_tokens=0, prompt_cache=cache):
            pass
        save_prompt_cache(cache_path, cache)
    else:
        cache = load_prompt_cache(cache_path)
        last = mx.array(prompt[-1:])
        token, _ = next(generate_step(last, model, max_tokens=1, prompt_cache=cache))
        ttft = time.perf_counter() - began
    return {"token": int(token), "ttft_s": ttft}


def llama_server_slots(
    model: BenchModel, quick: bool, binary: llamacpp.Binary, threads: int
) -> list[Measurement]:
    """llama-server's slot save/restore: cold and save in one server, restore in a fresh one."""
    assert model.gguf is not None
    prompt = prompt_for(model, quick)
    cold, hit, cached, differed = [], [], [], []
    for _ in range(ROUNDS.pick(model, quick)):
        with tempfile.TemporaryDirectory() as folder:
            argv = (
                *llamacpp.llama_server(binary.path, model.gguf, threads).argv,
                *("--parallel", "1", "--ctx-size", str(CONTEXT), "--swa-full"),
                *("--slot-save-path", folder),
            )
            command = ServerCommand(llamacpp.LLAMA_SERVER, argv, model.gguf.stem)
            with running([command]) as (server,):
                first = asyncio.run(_slot_run(server, prompt, restore=False))
            with running([command]) as (server,):
                second = asyncio.run(_slot_run(server, prompt, restore=True))
            if first["content"] != second["content"]:
                differed.append(f"{second['content']!r} vs {first['content']!r}")
            cold.append(first["ttft_s"])
            hit.append(second["ttft_s"])
            cached.append(float(len(prompt) - second["prompt_n"]))
    return rows(llamacpp.LLAMA_SERVER, model.name, cold, hit, cached, differed)


async def _slot_run(server: Server, prompt: list[int], restore: bool) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "cache_prompt": True,
            "id_slot": 0}  # fmt: skip
    file = {"filename": "prompt.bin"}
    began = time.perf_counter()
    if restore:
        restored = await post_json(server, "/slots/0?action=restore", file)
        if int(restored.get("n_restored", 0)) < len(prompt):
            raise RuntimeError(f"llama-server restored {restored}, not the {len(prompt)} tokens")
    answer = await post_json(server, "/completion", body)
    ttft = time.perf_counter() - began
    if not restore:
        await post_json(server, "/slots/0?action=save", file)
    return {"content": answer["content"], "ttft_s": ttft,
            "prompt_n": int(answer["timings"]["prompt_n"])}  # fmt: skip


def main() -> None:
    step, model_path, prompt_json, cache_path = sys.argv[1:5]
    print(json.dumps(_mlx_main(step, model_path, prompt_json, cache_path)))


if __name__ == "__main__":
    main()
