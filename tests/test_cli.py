"""The ``specserve`` command: one readable line and exit status 2 for bad input."""

from __future__ import annotations

import errno
import json
import os
import socket

import pytest
from specserve.cli import main
from specserve.serve.ports import bind_error

from tests.net import free_port


@pytest.mark.parametrize("args, message", [
    (["-k", "0"], "num_speculative_tokens: Input should be greater than or equal to 1"),
    (["--temperature", "-1"], "temperature: Input should be greater than or equal to 0"),
    (["--model", "/nope/model"], "model path '/nope/model' does not exist"),
    (["--method", "draft_model"], "needs a draft model"),
    (["--method", "draft_model", "--draft", "/nope/draft"], "'/nope/draft' does not exist"),
    (["--max-tokens", "0"], "max_tokens 0 only scores a prompt"),
    (["--repetition-penalty", "0"], "repetition_penalty: Input should be greater than 0"),
    (["--bad-word", " "], "a bad word needs a character that is not whitespace"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(["generate", "--prompt", "hi", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specserve: error: ") and message in err


@pytest.mark.slow
def test_generate_on_the_embedded_default(capsys):
    """No model flags: SmolLM2 with n-gram; the printed stats are the engine's."""
    code = main(["generate", "--chat", "--prompt", "Repeat exactly: one two three four five six",
                 "--max-tokens", "24", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["model"] == "SmolLM2-135M-Instruct"
    assert report["method"] == "ngram" and 0 < report["completion_tokens"] <= 24
    assert report["num_drafts"] > 0 and report["mean_acceptance_length"] > 1.0
    assert "one two three" in report["text"]


def test_serve_says_what_it_speculates_with(monkeypatch, capsys, tmp_path):
    """`make serve`'s config runs suffix decoding: the start-up line says so, and that it
    keeps the unit's last responses in memory. A config naming the shipped EAGLE draft with
    suffix in front is served as written when the draft is there (the line names the draft
    and what it measured), and as suffix alone, with a message, when it is missing."""
    import copy

    import yaml
    from specserve.app_config import AppConfig
    from specserve.engine.drafts import draft_head
    from specserve.serve import server

    shipped = yaml.safe_load(open("deploy/serve_config.yaml"))["applications"][0]["args"]
    assert server._default_draft_or_ngram(shipped) is shipped
    line = server._speculation_line(AppConfig.model_validate(shipped))
    assert line.startswith("speculation: suffix (suffix decoding") and "K up to 8" in line
    assert "caches the unit's last 256 responses in memory" in line

    args = copy.deepcopy(shipped)
    args["unit"]["engine"]["speculative"] |= {"method": "eagle", "first": "suffix",
                                              "num_speculative_tokens": 4,
                                              "draft": {"source": draft_head.EMBEDDED_DRAFT}}
    assert server._default_draft_or_ngram(args) is args  # the draft is there: used as configured
    line = server._speculation_line(AppConfig.model_validate(args))
    assert line.startswith("speculation: eagle, suffix first") and "embedded-eagle" in line
    assert "acceptance" in line and "at batch 1" in line  # from its eval.json
    assert capsys.readouterr().out == ""

    monkeypatch.setattr(draft_head, "EMBEDDED_DRAFT_DIR", tmp_path / "absent")
    fallback = server._default_draft_or_ngram(args)
    assert "not installed" in capsys.readouterr().out
    spec = fallback["unit"]["engine"]["speculative"]
    assert spec["method"] == "suffix" and "draft" not in spec and "first" not in spec
    assert server._speculation_line(AppConfig.model_validate(fallback)).startswith("speculation: suffix")
    assert args["unit"]["engine"]["speculative"]["method"] == "eagle"  # the input is untouched


@pytest.fixture
def listening():
    """A port this process listens on (on 127.0.0.1, as a server would)."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_serve_refuses_a_taken_port_in_one_line_naming_its_holder(monkeypatch, capsys, listening):
    """The server's first step, before its config or Ray (here in this process, as the server
    side of the supervisor): a taken ``--port`` or ``--metrics-port`` is one line naming the
    flag, the address and the process holding it (this one), exit status 2.
    ``tests/serve/test_server_process.py`` shows it with real servers."""
    from specserve.serve.server import SERVER_ENV

    monkeypatch.setenv(SERVER_ENV, "1")
    holder = f"(pid {os.getpid()}: "
    for flags in (["--port", str(listening)],
                  ["--port", str(free_port()), "--metrics-port", str(listening)]):
        assert main(["serve", "--config", "/nope.yaml", *flags]) == 2
        flag = flags[-2]
        err = capsys.readouterr().err
        assert err.startswith(f"specserve: error: {flag} {listening} on 127.0.0.1 is in use {holder}")
        assert err.endswith(f"; pick another with {flag}\n") and err.count("\n") == 1


def test_serve_chooses_a_free_metrics_port_when_the_default_is_taken(monkeypatch, capsys, listening):
    """No ``--metrics-port`` and the default taken (a port this test holds stands for 8080):
    a free one near it, said in one line that names the holder and what the Prometheus config
    scrapes. The check runs where nothing has started yet: it reads only the flags."""
    from specserve import cli
    from specserve.serve import server

    monkeypatch.setattr(server, "DEFAULT_METRICS_PORT", listening)
    chosen = server._check_ports(cli.build_parser().parse_args(["serve", "--port", str(free_port())]))
    out = capsys.readouterr().out
    assert chosen != listening and bind_error("127.0.0.1", chosen) is None
    assert out.count("\n") == 1 and out.startswith(
        f"specserve: Ray's metrics port {listening} is in use (pid {os.getpid()}: ")
    assert f"on {chosen} instead" in out and f"prometheus.yml scrapes {listening}" in out


def test_a_port_in_time_wait_is_free_and_a_listener_is_not(listening):
    """The probe binds as Ray's metrics agent and Serve's proxy do (SO_REUSEADDR): a port a
    stopped server left in TIME_WAIT (it closed a connection first) is free for them, so it
    is free for the check; a listener is not, whichever options it was bound with. (A
    TIME_WAIT left by a socket bound without SO_REUSEADDR would block them too.)"""
    assert bind_error("127.0.0.1", listening).errno == errno.EADDRINUSE
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as they bind
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = server.accept()
            conn.close()  # the server's side closes first: its port is left in TIME_WAIT
    assert bind_error("127.0.0.1", port) is None
