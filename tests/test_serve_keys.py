"""Who may use a real ``mlxrt serve`` process (docs/http.md "Security"): its API keys, each key's
own prefix cache, its limits per key, and the warning of a server open to the network.

Each server runs on an ephemeral port and is always stopped (tests/test_serve_process.py's
launcher); the official ``openai`` client is the client.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from runtime.cli import main
from runtime.cli.serve_keys import API_KEY_ENV
from tests.test_serve_process import REQUEST_TIMEOUT_S, mlxrt_serve, wait_for

ALICE, BOB = "alice-0123456789abcdef", "bob-fedcba9876543210"
PROMPT = "One prompt that both tenants send, word for word, to the same server. " * 2
SLOW = ("--model-option", "decode_s_per_token=0.01")  # a 500-token stream runs ~5 s


def key_file(tmp_path: Path) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(f"# the tenants of this server\n{ALICE}\n\n{BOB}\n")
    return str(path)


def client_for(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key=key, timeout=REQUEST_TIMEOUT_S, max_retries=0
    )


@contextlib.contextmanager
def alice_and_bob(url: str) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    """A client for each key, closed after (their connections with them)."""
    with client_for(url, ALICE) as alice, client_for(url, BOB) as bob:
        yield alice, bob


def cached_tokens(client: openai.OpenAI, model: str, prompt: str = PROMPT) -> tuple[int, int]:
    """(prompt tokens, of them served from the cache) of a 2-token completion."""
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_only_keys_get_in_and_each_key_has_its_own_cache(tmp_path: Path) -> None:
    with mlxrt_serve(
        "--backend", "simulated", "--model", "m", "--api-key-file", key_file(tmp_path)
    ) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # stays open
        for key in ("", "not-a-key", ALICE[:-1]):
            with (
                client_for(url, key or "-") as client,
                pytest.raises(openai.AuthenticationError) as refused,
            ):
                client.models.list()
            assert refused.value.code == "invalid_api_key"
            assert refused.value.status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 401
        metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {BOB}"})
        assert metrics.status_code == 200
        with alice_and_bob(url) as (alice, bob):
            prompt_tokens, hit = cached_tokens(alice, "m")
            assert hit == 0
            assert cached_tokens(bob, "m") == (prompt_tokens, 0)  # Bob prefills it all
            assert cached_tokens(alice, "m")[1] > 0  # Alice reuses her own
            assert cached_tokens(bob, "m")[1] > 0  # and Bob his


def test_mlxrt_ps_sends_the_key_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with mlxrt_serve("--backend", "simulated", "--model", "m", "--api-key", ALICE) as url:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        assert main(["ps", "--url", url]) == 1
        assert API_KEY_ENV in capsys.readouterr().err
        monkeypatch.setenv(API_KEY_ENV, ALICE)
        assert main(["ps", "--url", url]) == 0
        assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["m", "loaded"]


def test_a_key_over_its_limit_is_429_and_a_disconnect_frees_its_slot(tmp_path: Path) -> None:
    argv = ("--backend", "simulated", "--model", "m", *SLOW, "--api-key-file", key_file(tmp_path))
    with (
        mlxrt_serve(*argv, "--max-concurrent-per-key", "1") as url,
        alice_and_bob(url) as (alice, bob),
    ):
        stream = alice.completions.create(
            model="m", prompt="go on", max_tokens=500, temperature=0, stream=True
        )
        next(iter(stream))  # Alice's only slot is taken
        with pytest.raises(openai.RateLimitError) as limited:
            alice.completions.create(model="m", prompt="more", max_tokens=2)
        assert limited.value.code == "rate_limit_exceeded"
        assert limited.value.response.headers["retry-after"] == "1"
        assert bob.completions.create(model="m", prompt="hi", max_tokens=2).choices  # his own
        stream.close()  # Alice goes away mid-stream: the server frees her slot

        def admitted() -> bool:
            try:
                alice.completions.create(model="m", prompt="again", max_tokens=2)
            except openai.RateLimitError:
                return False
            return True

        wait_for(admitted, "Alice's slot to be freed by her disconnect", within_s=10)


def listening_output(*args: str) -> list[str]:
    """What ``mlxrt serve ARGS`` (simulated, on an ephemeral port) prints up to the line saying
    it listens; the process is stopped then."""
    argv = [sys.executable, "-m", "runtime.cli", "serve", "--quiet", "--no-disk-cache"]
    argv += ["--backend", "simulated"]
    lines: list[str] = []
    with subprocess.Popen(
        [*argv, "--model", "m", "--port", "0", *args],
        stderr=subprocess.STDOUT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, API_KEY_ENV: ""},
    ) as process:
        _read_until_listening(process, lines)
    assert any("Uvicorn running on" in line for line in lines), lines
    return lines


def _read_until_listening(process: subprocess.Popen[str], lines: list[str]) -> None:

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "Uvicorn running on" in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        reader.join(timeout=REQUEST_TIMEOUT_S)
    finally:
        process.terminate()
        process.wait(timeout=30)
    reader.join(timeout=30)  # the pipe ends with the process


@pytest.mark.parametrize(
    ("args", "warned"),
    [
        (("--host", "0.0.0.0"), True),
        (("--host", "0.0.0.0", "--api-key", ALICE), False),
        (("--host", "127.0.0.1"), False),
    ],
    ids=["all interfaces, no key", "all interfaces, a key", "loopback, no key"],
)
def test_listening_beyond_loopback_without_a_key_prints_one_warning(
    args: tuple[str, ...], warned: bool
) -> None:
    warnings = [line for line in listening_output(*args) if "without an API key" in line]
    assert len(warnings) == int(warned)
    if warned:
        assert warnings[0].startswith("mlxrt serve: warning: listening on 0.0.0.0:0")
        assert "--api-key" in warnings[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--api-key-file", "/no/such/keys"), "cannot read the API key file /no/such/keys"),
        (("--api-key", "has space"), "is not a usable API key"),
        (("--max-concurrent-per-key", "0"), "max_concurrent_per_key must be at least 1"),
        (("--max-queued-per-key", "2"), "--max-queued-per-key needs --max-concurrent-per-key"),
    ],
)
def test_bad_access_flags_are_usage_errors_before_any_load(
    args: tuple[str, ...], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--backend", "simulated", "--model", "m", *args])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert words in error and "has space" not in error


@pytest.mark.mlx
def test_a_tiny_mlx_model_keeps_each_keys_prompts_apart(tmp_path: Path) -> None:
    from runtime.testing.tiny_models import tiny_model_path

    model = f"tiny={tiny_model_path('llama')}"
    with (
        mlxrt_serve("--model", model, "--api-key", ALICE, "--api-key", BOB) as url,
        alice_and_bob(url) as (alice, bob),
    ):
        prompt_tokens, hit = cached_tokens(alice, "tiny")
        assert hit == 0
        assert cached_tokens(bob, "tiny") == (prompt_tokens, 0)
        again = cached_tokens(alice, "tiny")[1]
        assert 0 < again < prompt_tokens
        assert cached_tokens(alice, "tiny", PROMPT + " And more.")[1] > 0
        salted = alice.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"cache_salt": "user-2"}
        )
        assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
        assert salted.usage.prompt_tokens_details.cached_tokens == 0
