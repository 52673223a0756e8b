"""The disk tier's controls: the flags of `mlxrt serve` and `mlxrt chat` (on by default, under
the user cache folder), `mlxrt cache show|clear`, and what `/metrics` and the model card (so
`mlxrt ps`) show of it. The simulated backend persists its states too, so no model runs here."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.backends.disk import DiskCacheConfig, DiskStore, HostState, default_cache_dir
from runtime.cli import main
from runtime.cli.cache import add_disk_flags, disk_config, disk_note
from runtime.cli.models import _ps_table
from runtime.host.config import RuntimeConfig
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import sim_spec

pytestmark = pytest.mark.anyio


def parse(*argv: str) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser()
    add_disk_flags(parser)
    return parser.parse_args(list(argv)), parser


def test_the_disk_tier_is_on_by_default_under_the_user_cache_folder() -> None:
    config = disk_config(*parse())
    assert config is not None
    assert Path(config.directory) == default_cache_dir()
    assert config.budget_bytes == 4096 << 20
    assert str(default_cache_dir()) in disk_note(config)
    assert disk_config(*parse("--no-disk-cache")) is None
    mine = disk_config(*parse("--disk-cache", "/x/y", "--disk-cache-mib", "64"))
    assert mine == DiskCacheConfig(directory="/x/y", budget_bytes=64 << 20)
    with pytest.raises(SystemExit):
        disk_config(*parse("--disk-cache-mib", "-1"))


def test_mlxrt_cache_shows_and_clears_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for fingerprint in ("a" * 64, "b" * 64):
        state = HostState(2, "{}", {"x": np.zeros(1000, np.float32)})
        assert DiskStore(tmp_path, fingerprint, 1 << 30).write("n", (1, 2), True, state).written
    assert main(["cache", "show", "--disk-cache", str(tmp_path)]) == 0
    assert "2 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--disk-cache", str(tmp_path)]) == 0
    assert "deleted 2 entries" in capsys.readouterr().out
    assert not list(tmp_path.rglob("*.safetensors"))


async def test_metrics_and_the_model_card_show_the_disk_tier(tmp_path: Path) -> None:
    disk = DiskCacheConfig(directory=str(tmp_path))
    config = RuntimeConfig(kv_budget_bytes=64 << 20, disk_cache=disk)
    server = OpenAIServer(ServerConfig(models=(sim_spec("m", chunk=8),), runtime=config))
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": "m", "prompt": "hello there", "max_tokens": 3, "temperature": 0}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            await client.post("/v1/models/unload", json={"model": "m"})  # writes what RAM holds
            await client.post("/v1/models/load", json={"model": "m"})  # finds it on disk
            body["prompt"] = "hello there, again"
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            text = (await client.get("/metrics")).text
            cards = (await client.get("/v1/models")).json()["data"]
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("mlxrt_prefix_tier_total", (("model", "m"), ("tier", "disk")))] == 1
    assert samples[("mlxrt_disk_cache_entries", (("model", "m"),))] >= 1
    assert samples[("mlxrt_disk_hits_total", (("model", "m"),))] == 1
    [card] = [c for c in cards if c["id"] == "m"]
    assert card["disk_cache"]["entries"] >= 1
    assert card["disk_cache"]["hits"] == 1
    row = _ps_table([card]).splitlines()[1]
    assert f"{card['disk_cache']['entries']} entries" in row
    assert "1 hits" in row
    json.dumps(card)  # the card stays plain JSON


def test_a_restarted_chat_answers_its_first_turn_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mlxrt chat` quit and started again: the same instructions and first message are served
    from what the first run left on disk (all but the last prompt token cached)."""
    argv = ["chat", "--backend", "simulated", "--model", "sim", "--show-cache", "--quiet"]
    argv += [
        "--disk-cache",
        str(tmp_path),
        "--system",
        "answer in one short line",
        "--max-tokens",
        "4",
    ]
    shown = []
    for _ in range(2):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello there, my friend\n"))
        assert main(argv) == 0
        [line] = [x for x in capsys.readouterr().out.splitlines() if "[cached" in x]
        shown.append(line)
    assert shown[0].endswith("]") and "from disk" not in shown[0]
    assert shown[1].endswith(" from disk]")  # --show-cache says where it came from
    first, second = (
        line.partition("[cached ")[2].removesuffix("]").removesuffix(" from disk").split("/")
        for line in shown
    )
    assert first[0] == "0"
    assert int(second[0]) == int(second[1]) - 1  # warm: one token left to run


def test_a_resumed_chat_goes_on_at_warm_speed_from_what_the_last_run_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mlxrt chat` quit after a reply, then `mlxrt chat --resume`: the conversation goes on (the
    kept history), and the next turn's prompt (instructions, the first turn and its reply) is
    served from the disk tier the first run left, all but the new message."""
    history = tmp_path / "chats" / "sim.json"
    argv = ["chat", "--backend", "simulated", "--model", "sim", "--show-cache", "--quiet"]
    argv += ["--disk-cache", str(tmp_path / "disk"), "--history", str(history)]
    argv += ["--system", "answer in one short line", "--max-tokens", "4"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there, my friend\n"))
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert history.is_file()
    monkeypatch.setattr("sys.stdin", io.StringIO("and one more thing\n"))
    assert main([*argv, "--resume"]) == 0
    second = capsys.readouterr().out
    assert f"(resumed 1 replies from {history})" in second
    [shown] = [x for x in second.splitlines() if "[cached" in x]
    assert shown.endswith(" from disk]")
    cached, prompt = map(int, shown.partition("[cached ")[2].split(" ")[0].split("/"))
    [before] = [x for x in first.splitlines() if "[cached" in x]
    first_prompt = int(before.partition("[cached ")[2].removesuffix("]").split("/")[1])
    assert cached > first_prompt  # the first turn and its reply came from disk, not just the
    assert prompt > cached  # instructions; the new message was prefilled


def test_a_damaged_chat_history_is_said_and_the_chat_starts_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    history = tmp_path / "sim.json"
    history.write_text("{not json")
    argv = ["chat", "--backend", "simulated", "--model", "sim", "--quiet", "--no-disk-cache"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main([*argv, "--history", str(history), "--resume", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert f"(not resumed: {history} is not a saved chat" in out
    assert "starting afresh)" in out
    assert history.read_bytes().startswith(b"{")  # the reply was kept over it


def test_a_bad_disk_cache_config_is_refused_with_its_name() -> None:
    from runtime.errors import InvalidConfig

    for bad in ({"budget_bytes": -1}, {"shutdown_s": -1.0}):
        with pytest.raises(InvalidConfig, match="DiskCacheConfig"):
            DiskCacheConfig(directory="/tmp/x", **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="directory"):
        DiskCacheConfig(directory="")
