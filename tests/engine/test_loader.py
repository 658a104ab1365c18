"""Loading models through ``transformers``: local directories, GGUF, the embedded default,
hub ids; and the refusals that must happen before anything is loaded."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError
from specserve.config import EngineConfig, SamplingParams
from specserve.engine.builder import build_engine, check_draft_files
from specserve.engine.loader import EMBEDDED_NAME, resolve
from specserve.errors import ConfigError, ModelNotFoundError

from tests.engine.test_spec_decode import make_engine, prompts
from tests.models import tiny_hf_model
from tests.tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny model saved as a transformers directory (config.json + safetensors + tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-target")
    model = tiny_hf_model("qwen2-bias", seed=3)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path, model


def test_local_directory_loads_and_generates_like_the_model(tiny_dir):
    path, model = tiny_dir
    engine, target = build_engine(EngineConfig.model_validate(
        {"target": {"source": str(path)}, "speculative": {"method": "ngram"},
         "max_model_len": 256}))
    assert target.name == path.name and target.eos_token_ids == frozenset({2})
    batch = prompts(3)
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = make_engine(model, None).generate(batch, params)
    assert [c.output_token_ids for c in engine.generate(batch, params)] == \
        [c.output_token_ids for c in expected]


@pytest.mark.parametrize("source", ["/does/not/exist", "./nope", "missing.gguf", "a/b/c"])
def test_missing_model_path_is_a_clear_error(source):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve(source)
    cfg = EngineConfig.model_validate({"target": {"source": "embedded"}, "speculative": {
        "method": "draft_model", "draft": {"source": source}}})  # the shape is fine
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        check_draft_files(cfg)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve(str(tmp_path))


def test_hub_ids_are_passed_through_unresolved():
    """On a cluster a hub id is fetched by transformers; resolving it touches nothing."""
    src = resolve("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert (src.name, src.location) == ("HuggingFaceTB/SmolLM2-360M-Instruct",) * 2


def test_draft_with_another_tokenizer_is_refused_before_an_engine_loads(tiny_dir, tmp_path):
    """The config validates its shape anywhere (a Helm render, a Ray actor); the builder reads
    the tokenizers and refuses the draft before any model loads."""
    path, model = tiny_dir
    other = make_tiny_tokenizer().__class__.from_pretrained(path)
    other.add_tokens(["<|not-in-the-target|>"])
    model.save_pretrained(tmp_path)
    other.save_pretrained(tmp_path)
    spec = {"method": "draft_model", "draft": {"source": str(tmp_path)}}
    cfg = EngineConfig.model_validate({"target": {"source": str(path)}, "speculative": spec})
    with pytest.raises(ConfigError, match="does not share the target's tokenizer"):
        check_draft_files(cfg)
    with pytest.raises(ConfigError, match="does not share the target's tokenizer"):
        build_engine(cfg)
    same = {"method": "draft_model", "draft": {"source": str(path)}}
    check_draft_files(EngineConfig.model_validate({"target": {"source": str(path)},
                                                   "speculative": same}))


@pytest.mark.parametrize("bad, match", [
    ({"speculative": {"num_speculative_tokens": 0}}, "greater than or equal to 1"),
    ({"speculative": {"method": "draft_model"}}, "needs a draft model"),
    ({"speculative": {"method": "ngram", "draft": {"source": "x"}}}, "draft model is set"),
    ({"speculative": {"prompt_lookup_min": 5, "prompt_lookup_max": 2}}, "prompt_lookup_min"),
    ({"max_num_seqs": 0}, "greater than or equal to 1"),
    ({"target": {"dtype": "int3"}}, "dtype"),
    ({"unknown_field": 1}, "Extra inputs"),
])
def test_bad_engine_config_is_refused(bad, match):
    with pytest.raises(ValidationError, match=match):
        EngineConfig.model_validate(bad)


@pytest.mark.parametrize("bad, match", [
    ({"temperature": -0.1}, "greater than or equal to 0"),
    ({"temperature": 2.5}, "less than or equal to 2"),
    ({"top_p": 0.0}, "greater than 0"),
    ({"top_k": -1}, "greater than or equal to 0"),
    ({"max_tokens": 0}, "max_tokens 0 only scores a prompt"),
    ({"stop": [""]}, "non-empty"),
])
def test_bad_sampling_params_are_refused(bad, match):
    with pytest.raises(ValidationError, match=match):
        SamplingParams.model_validate(bad)


@pytest.mark.slow
def test_embedded_default_is_cached_as_safetensors():
    src = resolve("embedded")
    files = {p.name for p in __import__("pathlib").Path(src.location).iterdir()}
    assert src.name == EMBEDDED_NAME
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert resolve("embedded") == src  # the second time it is the same cache entry


def test_a_gguf_copy_is_found_by_content_whatever_its_path_and_mtime(tmp_path):
    """A reinstall puts the same GGUF at a new path with a new mtime: its dequantized copy is
    the one the first made (before, each reinstall dequantized again: 540 MB more each time,
    and half a minute). Another content is another copy. (The files here are not GGUF:
    dequantizing one would raise: finding the copy shows nothing was dequantized.)"""
    import os
    import shutil

    from specserve.engine.loader import _content_digest, _dequantized

    cache = tmp_path / "cache"
    first = tmp_path / "venv-a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    copy = cache / "models" / f"model-{hashlib.sha256(first.read_bytes()).hexdigest()[:12]}"
    copy.mkdir(parents=True)
    (copy / "config.json").write_text("{}")
    again = tmp_path / "venv-b" / "model.gguf"
    again.parent.mkdir()
    shutil.copyfile(first, again)
    os.utime(again, ns=(1, 1))
    assert _dequantized(first, cache) == copy and _dequantized(again, cache) == copy
    assert len(list((cache / "models" / ".digests").iterdir())) == 2  # hashed once per file
    other = tmp_path / "venv-c" / "model.gguf"
    other.parent.mkdir()
    other.write_bytes(first.read_bytes()[:-1] + b"x")
    assert _content_digest(other, cache)[:12] not in copy.name  # another copy's name
