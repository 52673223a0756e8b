"""The host programs in examples/ run as a person runs them (``python examples/X.py``), in a
subprocess, on the tiny llama model (fast) and on the default real model (``real_model``); each
test reads what the program printed and checks it against what the program did."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from runtime.testing.tiny_models import tiny_model_path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RUN_TIMEOUT_S = 100  # under pytest's per-test timeout, so a hang fails with the output so far


def example_env() -> dict[str, str]:
    """This checkout's runtime first on the path (not an installed copy), output unbuffered."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def run_example(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        env=example_env(),
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(tiny_model_path("llama"))


@pytest.fixture
def real_model(real_gguf: Callable[[str], Path]) -> str:
    """The default model's name; skips as ``real_gguf`` does when it cannot be had."""
    real_gguf("smollm2-135m-instruct")
    return "smollm2-135m-instruct"


@pytest.mark.parametrize("name", ["autocomplete_host.py", "chat_host.py", "starlette_service.py"])
def test_each_example_explains_itself_with_examples(name: str) -> None:
    shown = run_example(name, "--help")
    assert "--model PATH" in shown and "examples:" in shown and f"examples/{name}" in shown


# ---------------------------------------------------------------- the autocomplete host


def check_autocomplete(output: str) -> None:
    """The figures printed agree with the script typed and with each other."""
    host = load_example("autocomplete_host.py")
    typed = [text for action, text in host.SCRIPT if action == "type"]
    keys = sum(len(text) + text.count("~") for text in typed)  # a typo is a key and a backspace
    focuses = sum(action == "focus" for action, _ in host.SCRIPT)
    assert int(re.search(r"typed (\d+) keys", output)[1]) == keys  # type: ignore[index]
    endings = {
        what: int(n)
        for n, what in re.findall(r"(\d+) ([a-z][a-z ]+?)(?:,|$)", _line(output, "suggestions:"))
    }
    assert sum(endings.values()) == keys  # every keystroke's suggestion ended one way
    superseded = sum(n for what, n in endings.items() if what.startswith("superseded"))
    runtime = _line(output, "runtime:")
    assert int(re.search(r"(\d+) completions superseded", runtime)[1]) == superseded  # type: ignore[index]
    p50, p90, p99 = map(float, re.findall(r"p\d\d ([\d.]+) ms", _line(output, "keystroke to")))
    assert 0 < p50 <= p90 <= p99
    prewarms = re.findall(r"(\d+) [a-z]+", _line(output, "prewarms on focus:"))
    assert sum(map(int, prewarms)) == focuses
    reused = int(re.search(r"(\d+) prompt tokens reused", output)[1])  # type: ignore[index]
    assert reused > 0  # each keystroke's prompt extends the one before it


def _line(output: str, start: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith(start)]
    return line


def test_the_autocomplete_host_reports_consistent_latency_abort_and_reuse_figures(
    tiny: str,
) -> None:
    check_autocomplete(run_example("autocomplete_host.py", "--model", tiny, "--pace-ms", "5", "15"))


@pytest.mark.real_model
def test_the_autocomplete_host_on_the_default_model(real_model: str) -> None:
    # Its usage's "fast typist": at the default 100-200 ms a key, ~20 s of the run is the pauses.
    pace = ("--pace-ms", "40", "80")
    check_autocomplete(run_example("autocomplete_host.py", "--max-tokens", "4", *pace))


# ---------------------------------------------------------------- the chat host


def chat_turns(output: str) -> list[tuple[int, int, int]]:
    """(cached, prompt tokens, turns dropped) of each reply, in order."""
    pattern = r"\[cached (\d+)/(\d+) prompt tokens, turns dropped by the window: (\d+)"
    return [(int(c), int(p), int(d)) for c, p, d in re.findall(pattern, output)]


def test_the_chat_host_reuses_earlier_turns_and_drops_the_oldest_past_its_window(
    tiny: str,
) -> None:
    output = run_example("chat_host.py", "--model", tiny, "--max-tokens", "12")
    turns = chat_turns(output)
    host = load_example("chat_host.py")
    assert len(turns) == sum(len(asked) for _, asked in host.CONVERSATIONS.values())
    # ada, bob, ada, bob, ada, ada: each user's second turn reuses their first
    assert turns[2][0] > 0 and turns[3][0] > 0
    assert any(dropped > 0 for _, _, dropped in turns)  # the 100-token window dropped turns
    assert all(cached > 0 for cached, _, dropped in turns if dropped)  # instructions pinned
    assert output.count("its pinned instructions prefix released") == 2


@pytest.mark.real_model
def test_the_chat_host_on_the_default_model(real_model: str) -> None:
    turns = chat_turns(run_example("chat_host.py", "--max-tokens", "24"))
    assert len(turns) == 6 and turns[2][0] > 0 and turns[3][0] > 0


# ---------------------------------------------------------------- the Starlette service


@contextlib.contextmanager
def serve(*args: str) -> Iterator[str]:
    """Start the service on a free port; yield its base URL once it is ready; stop it with
    Ctrl-C (SIGINT) and check it exits cleanly."""
    with subprocess.Popen(
        [sys.executable, str(EXAMPLES / "starlette_service.py"), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=example_env(),
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            for line in process.stdout:  # ends at EOF if the service dies first
                if match := re.match(r"ready on (http://\S+)", line):
                    break
            else:
                raise AssertionError(f"the service never got ready: {process.stderr.read()}")
            yield match[1]
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == 0, process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()


def check_service(base: str, model: str) -> None:
    with httpx.Client(base_url=base, timeout=60) as client:
        own = client.post("/suggest", json={"user": "ada", "text": "The capital of France is"})
        assert own.status_code == 200 and own.json()["status"] == "shown"
        again = client.post("/suggest", json={"user": "ada", "text": "The capital of France is"})
        assert again.json()["cached_tokens"] > 0  # the first request's prompt, reused
        bad = client.post("/suggest", json={"user": "ada"})
        assert bad.status_code == 400 and "text" in bad.json()["error"]
        status = client.get("/status").json()
        assert status["model"] == model and status["counters"]["decoded_tokens"] > 0
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4}
        completion = client.post("/openai/v1/completions", json=body)
        assert completion.status_code == 200
        assert completion.json()["usage"]["completion_tokens"] > 0
        assert [m["id"] for m in client.get("/openai/v1/models").json()["data"]] == [model]


def test_the_service_answers_its_own_routes_and_the_mounted_openai_api(tiny: str) -> None:
    with serve("--model", tiny, "--name", "tiny") as base:
        check_service(base, "tiny")


@pytest.mark.real_model
def test_the_service_on_the_default_model(real_model: str) -> None:
    with serve() as base:
        check_service(base, "assistant")
