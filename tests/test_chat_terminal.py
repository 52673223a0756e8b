"""``mlxrt chat`` in a real terminal: tmux types into it and reads its screen.

Each wait polls the screen for a condition until a generous deadline: waiting for a condition,
never timing anything.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.backends.model_store import DEFAULT_MODEL
from runtime.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 120.0  # a generous bound on one wait: a loaded 2-core machine is slow, not stuck
EXITED = "mlxrt exited with"


class Terminal:
    """A 120x40 tmux pane running one command, on a tmux server of its own."""

    def __init__(self, socket: str) -> None:
        self.socket = socket

    def tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True
        )
        return done.stdout

    def type(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "chat", *keys)

    def screen(self) -> str:
        """Everything the pane has shown, scrolled-off lines included."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def wait_for(self, what: str, condition: Callable[[str], bool]) -> str:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            screen = self.screen()
            if condition(screen):
                return screen
            if time.monotonic() > deadline:
                pytest.fail(f"the terminal never showed {what}; it shows:\n{screen}")
            time.sleep(0.05)  # between two looks at the screen, not to order anything

    def wait_for_prompt(self, replies: int) -> str:
        """Until ``replies`` replies have ended and the prompt is back."""
        return self.wait_for(
            f"{replies} replies and the prompt",
            lambda screen: len(cached(screen)) >= replies and last_line(screen) == ">",
        )


def cached(screen: str) -> list[tuple[int, int]]:
    return [(int(n), int(m)) for n, m in re.findall(r"\[cached (\d+)/(\d+)\]", screen)]


def last_line(screen: str) -> str:
    lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def text_after(screen: str, typed: str) -> str:
    """What the pane shows after the line where ``typed`` was entered."""
    return screen.rpartition(f"> {typed}")[2].strip()


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    # A socket of its own per test: a server just killed may still hold the last one's name.
    term = Terminal(f"mlxrt-chat-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield term
    finally:
        subprocess.run(["tmux", "-L", term.socket, "kill-server"], capture_output=True)


def start_chat(terminal: Terminal, *args: str) -> None:
    env = {
        "PYTHONPATH": str(REPO),
        "TERM": "xterm",
        **{k: v for k, v in os.environ.items() if k in ("LD_PRELOAD", "HOME", "MLXRT_CACHE_DIR")},
    }
    # Memory only: a test never writes to the user's cache folder.
    command = [sys.executable, "-m", "runtime.cli", "chat", "--show-cache", "--no-disk-cache"]
    command += args
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    # The pane outlives the process, so its exit status can be read off the screen.
    shell = f"env {assignments} {shlex.join(command)}; echo {EXITED} $?; sleep 600"
    terminal.tmux("new-session", "-d", "-s", "chat", "-x", "120", "-y", "40", shell)
    terminal.wait_for("the first prompt", lambda screen: last_line(screen) == ">")


def test_a_chat_on_a_tiny_model_in_a_real_terminal(terminal: Terminal) -> None:
    start_chat(terminal, "--model", f"tiny={tiny_model_path('llama')}", "--max-tokens", "500")

    terminal.type("hello there", "Enter")
    screen = terminal.wait_for_prompt(1)
    assert text_after(screen, "hello there"), "the reply was streamed to the screen"
    [(_, first_prompt)] = cached(screen)

    terminal.type("and again", "Enter")
    [_, (reused, _)] = cached(terminal.wait_for_prompt(2))
    assert reused >= first_prompt, "turn 2 reused the KV of turn 1"

    # Ctrl-C as soon as the reply shows: it stops, the chat goes on.
    terminal.type("a long story please", "Enter")
    terminal.wait_for(
        "the long reply streaming", lambda screen: bool(text_after(screen, "a long story please"))
    )
    terminal.type("C-c")
    terminal.wait_for(
        "the reply cancelled and the prompt back",
        lambda screen: "(cancelled)" in screen and last_line(screen) == ">",
    )
    terminal.type("still there?", "Enter")
    screen = terminal.wait_for_prompt(4)
    assert EXITED not in screen
    assert cached(screen)[-1][0] > first_prompt, "the session kept its conversation"

    terminal.type("/reset", "Enter")
    terminal.wait_for("the reset", lambda screen: "(new conversation)" in screen)
    terminal.type("hello there", "Enter")
    assert cached(terminal.wait_for_prompt(5))[-1][1] == first_prompt, "a fresh conversation"

    terminal.type("/exit", "Enter")
    terminal.wait_for("the chat ended", lambda screen: f"{EXITED} 0" in screen)


@pytest.mark.parametrize("key", ["C-c", "C-d"])
def test_ctrl_c_or_ctrl_d_at_the_prompt_ends_the_chat(terminal: Terminal, key: str) -> None:
    start_chat(terminal, "--backend", "simulated", "--model", "sim")
    terminal.type(key)
    terminal.wait_for(f"the chat ended by {key}", lambda screen: f"{EXITED} 0" in screen)


@pytest.mark.real_model
def test_a_chat_on_the_default_model_in_a_real_terminal(
    terminal: Terminal, real_gguf: Callable[[str], Path]
) -> None:
    real_gguf(DEFAULT_MODEL)  # fetched (or skipped) as every real-model test does
    # No --model: the default model. On MLX: its float32 path answers these; llama.cpp's Q4_1
    # kernels (what auto picks on a CPU) do not, as llama-cpp-python's own chat does not.
    start_chat(terminal, "--max-tokens", "48", "--backend", "mlx")
    terminal.type("What is the capital of France?", "Enter")
    screen = terminal.wait_for_prompt(1)
    assert "Paris" in text_after(screen, "What is the capital of France?")
    [(_, first_prompt)] = cached(screen)
    terminal.type("And of Germany?", "Enter")
    screen = terminal.wait_for_prompt(2)
    assert "Berlin" in text_after(screen, "And of Germany?")
    assert cached(screen)[1][0] > first_prompt, "turn 2 reused turn 1 and its reply"
    terminal.type("/exit", "Enter")
    terminal.wait_for("the chat ended", lambda screen: f"{EXITED} 0" in screen)
