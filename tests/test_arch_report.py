"""The docs table of the architecture matrix, rendered from a run's JSON (no model runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.testing.arch_report import BEGIN, CASES, END, render, write_section

FAILED = (
    "fail: AssertionError: ended Failed: Failed(request_id='r', incarnation=1, "
    "code='backend_error', message=\"model step failed: CannotTrim('no copy rule for cache "
    "type CacheList')\", retryable=True, usage=Usage(prompt_tokens=220))"
)
RESULTS = {
    "unbuildable": {"bitnet": "Metal only"},
    "architectures": {
        "llama": {
            "facts": {
                "cache_kinds": "KVCache",
                "reuse_path": "trim",
                "batch_joins": 4,
                "prefills_together": 1,
                "limits": {},
            },
            "cases": dict.fromkeys(CASES, "pass"),
        },
        "mamba2": {
            "facts": {
                "cache_kinds": "ArraysCache",
                "reuse_path": "checkpoint",
                "checkpoint_spacing": 512,
                "batch_joins": 4,
                "probe_s": 0.0123,
                "limits": {"batch_prefill": "differs | by up to 4.1"},
            },
            "cases": {
                **dict.fromkeys(CASES, "pass"),
                "together": "fail: AssertionError: stream 0: (1, 2)",
            },
        },
        "falcon_h1": {
            "facts": {"cache_kinds": "CacheList(ArraysCache, KVCache)", "reuse_path": "checkpoint"},
            "cases": dict.fromkeys(CASES, FAILED),
        },
        "nemotron-nas": {"load": "ModelLoadFailed: no", "facts": {"cache_kinds": "KVCache"}},
    },
}


def test_rows_say_what_each_architecture_did() -> None:
    rows = {line.split(" | ")[0].strip("| `"): line for line in render(RESULTS).splitlines()}
    assert "4 architectures built and run; 1 pass every case" in render(RESULTS)
    assert rows["llama"].endswith("| trim | — | decode + prefill | — | pass |")
    assert (
        "| 512 tokens | decode | 0.01 s. batch_prefill off: differs \\| by up to 4.1 "
        "| together: output differs" in rows["mamba2"]
    )
    assert (
        "every case: model step failed: CannotTrim('no copy rule for cache type CacheList') |"
        in rows["falcon_h1"]
    )
    assert "the load fails: ModelLoadFailed: no" in rows["nemotron-nas"]
    assert rows["bitnet"] == "| `bitnet` | Metal only |"


def test_the_section_replaces_only_what_lies_between_its_markers(tmp_path: Path) -> None:
    docs = tmp_path / "models.md"
    docs.write_text(f"# Models\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n", encoding="utf-8")
    write_section(docs, "new table")
    assert docs.read_text(encoding="utf-8") == (
        f"# Models\n\nbefore\n{BEGIN}\nnew table\n{END}\nafter\n"
    )
    docs.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="markers"):
        write_section(docs, "new table")
