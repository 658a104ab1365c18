"""The ``specserve`` command: one readable line and exit status 2 for bad input."""

from __future__ import annotations

import json

import pytest
from specserve.cli import main


@pytest.mark.parametrize("args, message", [
    (["-k", "0"], "num_speculative_tokens: Input should be greater than or equal to 1"),
    (["--temperature", "-1"], "temperature: Input should be greater than or equal to 0"),
    (["--model", "/nope/model"], "model path '/nope/model' does not exist"),
    (["--method", "draft_model"], "needs a draft model"),
    (["--method", "draft_model", "--draft", "/nope/draft"], "'/nope/draft' does not exist"),
    (["--max-tokens", "0"], "max_tokens 0 only scores a prompt"),
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
    from specserve import cli
    from specserve.config import AppConfig
    from specserve.engine import draft_head

    shipped = yaml.safe_load(open("deploy/serve_config.yaml"))["applications"][0]["args"]
    assert cli._default_draft_or_ngram(shipped) is shipped
    line = cli._speculation_line(AppConfig.model_validate(shipped))
    assert line.startswith("speculation: suffix (suffix decoding") and "K up to 8" in line
    assert "caches the unit's last 256 responses in memory" in line

    args = copy.deepcopy(shipped)
    args["unit"]["engine"]["speculative"] |= {"method": "eagle", "first": "suffix",
                                              "num_speculative_tokens": 4,
                                              "draft": {"source": draft_head.EMBEDDED_DRAFT}}
    assert cli._default_draft_or_ngram(args) is args  # the draft is there: used as configured
    line = cli._speculation_line(AppConfig.model_validate(args))
    assert line.startswith("speculation: eagle, suffix first") and "embedded-eagle" in line
    assert "acceptance" in line and "at batch 1" in line  # from its eval.json
    assert capsys.readouterr().out == ""

    monkeypatch.setattr(draft_head, "EMBEDDED_DRAFT_DIR", tmp_path / "absent")
    fallback = cli._default_draft_or_ngram(args)
    assert "not installed" in capsys.readouterr().out
    spec = fallback["unit"]["engine"]["speculative"]
    assert spec["method"] == "suffix" and "draft" not in spec and "first" not in spec
    assert cli._speculation_line(AppConfig.model_validate(fallback)).startswith("speculation: suffix")
    assert args["unit"]["engine"]["speculative"]["method"] == "eagle"  # the input is untouched
