"""``mlxrt chat``: its commands and conversation on the simulated backend (no terminal; the real
terminal is tests/test_chat_terminal.py)."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator

import pytest
from anyio.from_thread import start_blocking_portal

from runtime.backends.model_store import DEFAULT_MODEL
from runtime.cli import main
from runtime.cli.chat_commands import HELP, Exit, Help, Reset, Say, SetSystem, Unknown, parse_line
from runtime.cli.chat_session import ChatSettings, ChatTerminal, Conversation, Reply, run_chat
from runtime.cli.model_args import model_specs
from runtime.host.api import Runtime
from runtime.messages import ChatMessage, ModelSpec

SIM = ModelSpec(name="sim", backend="simulated")


def scripted(*lines: str | type[BaseException]) -> tuple[list[str], object]:
    """A ``read_line`` that answers each prompt with the next line (or raises the exception),
    and the prompts it was shown."""
    prompts: list[str] = []
    answers: Iterator[str | type[BaseException]] = iter(lines)

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        answer = next(answers, EOFError)
        if isinstance(answer, str):
            return answer
        raise answer()

    return prompts, read_line


def chat(*lines: str | type[BaseException], **settings: object) -> str:
    """The chat's output; chat-framed unless ``framing`` says otherwise (the simulated model has
    no chat template, so by default it would be a raw completion)."""
    out = io.StringIO()
    _, read_line = scripted(*lines)
    settings = {"framing": "chat", **settings}
    run_chat(SIM, ChatSettings(**settings), read_line=read_line, out=out)  # type: ignore[arg-type]
    return out.getvalue()


def cached(output: str) -> list[tuple[int, int]]:
    return [(int(n), int(m)) for n, m in re.findall(r"\[cached (\d+)/(\d+)\]", output)]


def test_lines_become_commands() -> None:
    assert parse_line("  ") is None
    assert parse_line("hello /reset") == Say("hello /reset")
    assert parse_line("/reset") == Reset()
    assert parse_line("/system  Be terse. ") == SetSystem("Be terse.")
    assert parse_line("/system") == SetSystem(None)
    assert parse_line("/exit") == Exit() == parse_line("/quit")
    assert parse_line("/nope x") == Unknown("/nope")


def test_the_conversation_sends_its_instructions_first_and_forgets_what_it_is_told() -> None:
    conversation = Conversation(system="Be terse.")
    for question in ("one", "two", "three"):
        conversation.ask(question)
        conversation.answered(f"re {question}")
    assert conversation.messages()[0] == ChatMessage(role="system", content="Be terse.")
    conversation.drop_oldest_turns(2)
    assert [m.content for m in conversation.messages()] == ["Be terse.", "three", "re three"]
    conversation.ask("unanswered")
    conversation.withdraw_question()
    assert conversation.turns[-1].content == "re three"
    session = conversation.session
    conversation.reset()
    assert conversation.turns == [] and conversation.session != session
    assert conversation.system == "Be terse."


def test_each_turn_reuses_the_kv_of_the_turns_before_it() -> None:
    output = chat("hello", "and again", show_cache=True, max_tokens=6)
    [(n1, m1), (n2, m2)] = cached(output)
    assert n1 == 0
    assert n2 >= m1, "turn 2 reuses at least turn 1's whole prompt"
    assert m2 > n2


def test_cache_figures_are_shown_only_when_asked() -> None:
    assert cached(chat("hello", max_tokens=4)) == []


def test_reset_starts_a_new_conversation_and_system_sets_instructions() -> None:
    output = chat("hello", "/reset", "hello", "/system Be terse.", "hello", show_cache=True)
    (_, first), (_, after_reset), (_, with_system) = cached(output)
    assert after_reset == first, "after /reset the prompt is the first turn's again"
    assert with_system > first
    assert "(new conversation)" in output
    assert "(instructions: Be terse.)" in output


def test_ctrl_d_ctrl_c_and_exit_at_the_prompt_end_the_chat() -> None:
    for ending in (EOFError, KeyboardInterrupt, "/exit"):
        prompts, read_line = scripted("hello", ending, "never read")
        run_chat(SIM, ChatSettings(max_tokens=4), read_line=read_line, out=io.StringIO())
        assert len(prompts) == 2


def test_an_unknown_command_says_which_commands_exist() -> None:
    output = chat("/nope")
    assert "unknown command /nope" in output and "/reset" in output


def test_help_lists_the_commands() -> None:
    assert parse_line("/help") == Help() == parse_line("/?")
    output = chat("/help")
    assert output.count(HELP) == 2  # once at the start, once asked for
    assert all(command in HELP for command in ("/help", "/reset", "/system", "/stats", "/exit"))


def test_stats_shows_the_last_reply_s_speed() -> None:
    output = chat("/stats", "hello", "/stats", max_tokens=5)
    assert "(no reply yet)" in output
    [line] = re.findall(r"\(prompt \d+ tokens \(\d+ cached\) [\d.]+ s, 5 tokens [\d.]+ s, "
                        r"[\d.]+ tok/s\)", output)  # fmt: skip
    assert line


def test_stats_after_each_reply_when_asked() -> None:
    assert len(re.findall(r"tok/s\)", chat("one", "two", stats=True, max_tokens=3))) == 2


def test_a_model_without_a_chat_template_chats_as_a_raw_completion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """issue 21: a model without a template is not framed with a made-up one: each line goes
    on the running text, and one line on stderr says so."""
    out = io.StringIO()
    _, read_line = scripted("Once upon", "and then")
    run_chat(SIM, ChatSettings(max_tokens=4, show_cache=True), read_line=read_line, out=out)
    assert capsys.readouterr().err.count("sim has no chat template") == 1
    [(_, first), (cached_2, second)] = cached(out.getvalue())
    assert first == len(b"Once upon") and cached_2 >= first  # raw bytes, no "user: " frame
    assert second > first
    framed = io.StringIO()
    _, read_line = scripted("Once upon")
    settings = ChatSettings(max_tokens=4, show_cache=True, framing="chat")
    run_chat(SIM, settings, read_line=read_line, out=framed)
    [(_, chat_framed)] = cached(framed.getvalue())
    assert chat_framed > first  # "user: Once upon\nassistant: "
    assert capsys.readouterr().err == ""


def test_the_raw_conversation_is_the_text_so_far() -> None:
    conversation = Conversation(system="A story.", raw=True)
    conversation.ask("Once upon")
    conversation.answered(" a time")
    conversation.ask("The end")
    assert conversation.text() == "A story.\nOnce upon a time\nThe end"


def test_a_failed_reply_is_reported_and_its_question_forgotten() -> None:
    tiny_context = ModelSpec(name="sim", backend="simulated", options={"context_length": 16})
    out = io.StringIO()
    _, read_line = scripted("a question far too long for sixteen tokens of context", "hi")
    run_chat(tiny_context, ChatSettings(max_tokens=8), read_line=read_line, out=out)
    assert "(failed: context_length_exceeded" in out.getvalue()


def test_a_refused_reply_is_reported_and_the_chat_goes_on() -> None:
    out = io.StringIO()
    prompts, read_line = scripted("hello", "hello again")
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(Runtime()) as rt,
    ):  # no model loaded: every request is refused
        ChatTerminal(portal, rt, "absent", 4096, ChatSettings(), read_line=read_line, out=out).run()
    assert out.getvalue().count("(refused: model_not_loaded") == 2
    assert len(prompts) == 3


@pytest.mark.parametrize(
    ("shown", "kept"),
    [("partial rep", ["hello", "partial rep"]), ("", [])],
    ids=["text-shown", "nothing-shown"],
)
def test_a_cancelled_reply_keeps_what_was_shown_or_drops_the_turn(
    monkeypatch: pytest.MonkeyPatch, shown: str, kept: list[str]
) -> None:
    async def interrupted_reply(*_: object) -> Reply:
        return Reply(shown, None, None)  # what stream_reply returns after Ctrl-C

    monkeypatch.setattr("runtime.cli.chat_session.stream_reply", interrupted_reply)
    out = io.StringIO()
    _, read_line = scripted("hello")
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(Runtime()) as rt:
        terminal = ChatTerminal(portal, rt, "m", 4096, ChatSettings(), read_line=read_line, out=out)
        terminal.run()
    assert [m.content for m in terminal.conversation.turns] == kept
    assert "(cancelled)" in out.getvalue()


def test_the_model_argument_is_a_path_a_name_and_path_a_known_model_or_the_default() -> None:
    def chat_model(value: str | None) -> tuple[str, str | None]:
        [spec] = model_specs([value] if value else [], "mlx", [])
        return spec.name, spec.path

    assert chat_model(None) == (DEFAULT_MODEL, DEFAULT_MODEL)
    assert chat_model("gemma3-270m") == ("gemma3-270m", "gemma3-270m")
    assert chat_model("/m/SmolLM2.Q4_1.gguf") == ("SmolLM2.Q4_1", "/m/SmolLM2.Q4_1.gguf")
    assert chat_model("/m/llama-dir/") == ("llama-dir", "/m/llama-dir/")
    assert chat_model("smol=/m/llama-dir") == ("smol", "/m/llama-dir")


def test_mlxrt_chat_reads_the_terminal_and_ends_at_its_end(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n"))
    argv = ["chat", "--backend", "simulated", "--model", "sim", "--show-cache", "--quiet"]
    assert main([*argv, "--max-tokens", "5", "--no-disk-cache"]) == 0
    captured = capsys.readouterr()
    assert len(cached(captured.out)) == 2
    assert captured.err == ""  # --quiet: no load note


def test_mlxrt_chat_refuses_bad_arguments_before_loading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (
        ["--model", "=x"],
        ["--max-tokens", "0"],
        ["--temperature", "-1"],
        ["--temp", "-1"],
        ["--ctx-size", "0"],
    ):
        with pytest.raises(SystemExit) as exited:
            main(["chat", *argv])
        assert exited.value.code == 2
    assert "NAME=PATH" in capsys.readouterr().err


def test_the_help_shows_the_commands_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["chat", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for shown in ("Ctrl-C during a reply", "/reset", "/system TEXT", "/exit", "examples:"):
        assert shown in text


def test_show_cache_says_how_many_drafts_were_accepted_on_a_speculating_model() -> None:
    from runtime.testing.tiny_models import tiny_model_path

    # The tiny sliding-window model's greedy text falls into a loop: drafts are found.
    path = str(tiny_model_path("sliding"))
    spec = ModelSpec(name="tiny", backend="mlx", path=path, options={"speculative": 4})
    out = io.StringIO()
    _, read_line = scripted("Once upon a time, in a land far away, there lived")
    settings = ChatSettings(max_tokens=60, show_cache=True, framing="raw")
    run_chat(spec, settings, read_line=read_line, out=out)
    shown = re.findall(r"\[drafts accepted (\d+)/(\d+), ([\d.]+) tokens a pass\]", out.getvalue())
    [(accepted, drafted, per_pass)] = shown
    assert 0 < int(accepted) <= int(drafted)
    assert float(per_pass) > 1.0  # accepted drafts came several to a pass


def test_tokens_a_pass_count_the_prefills_token_apart() -> None:
    from runtime.cli.chat_session import tokens_per_pass

    assert tokens_per_pass(11, 0) == 1.0  # 10 plain passes after the prefill's token
    assert tokens_per_pass(11, 5) == 2.0  # 5 passes, each its own token and one accepted draft
    assert tokens_per_pass(1, 0) == 1.0  # only the prefill's token: no pass to divide by
