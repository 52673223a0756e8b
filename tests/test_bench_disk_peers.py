"""The disk group's mlx-lm peer (bench/disk_peers.py) on a tiny model: mlx-lm's own prompt cache
file written by one process and restored by a fresh one answers the prompt's first token alike
(the child checks it), and the rows are the disk group's, under system ``mlx-lm``."""

from __future__ import annotations

from bench import disk_peers
from bench.models import load_bench_model


def test_mlx_lms_prompt_cache_file_is_measured_in_a_fresh_process() -> None:
    model = load_bench_model("llama")
    rows = disk_peers.mlx_lm_file(model, quick=True)
    by_name = {row.scenario: row for row in rows}
    assert {row.system for row in rows} == {"mlx-lm"}
    assert set(by_name) == {
        "disk.cold_ttft",
        "disk.hit_ttft",
        "disk.hit/cold",
        "disk.cached_tokens",
    }
    prompt = disk_peers.prompt_for(model, quick=True)
    assert by_name["disk.cached_tokens"].value == len(prompt) - 1
    cold, hit = by_name["disk.cold_ttft"].value, by_name["disk.hit_ttft"].value
    assert cold is not None and hit is not None and cold > 0 and hit > 0
    assert by_name["disk.hit/cold"].value is not None
    assert by_name["disk.hit_ttft"].note == ""  # the restored first token is the cold one
