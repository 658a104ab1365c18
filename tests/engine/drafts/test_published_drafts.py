"""EAGLE-3 heads in their published formats (issue 37): tiny checkpoints written exactly as
the EAGLE authors, SpecForge and ``speculators`` write them (file names, config fields,
tensor names; docs/DRAFTS.md), loaded by the engine, checked against a reference forward
written from the published formula, and served with greedy output identical to target-only.
No checkpoint can be downloaded here: these are random heads of the right shapes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from specserve.config import EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
from specserve.engine.builder import check_draft_files, load_draft_proposer
from specserve.engine.drafts.draft_head import (
    eagle3_target_layers,
    is_draft_dir,
    load_draft_head,
    read_draft_meta,
)
from specserve.engine.drafts.eagle import EagleProposer
from specserve.engine.runtime.forward_batch import ForwardBatch
from specserve.engine.runtime.model import rope_tables
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.errors import ConfigError
from transformers import LlamaConfig

from tests.models import VOCAB, tiny_hf_model, worker_of, write_agreeing_eagle3_head
from tests.tiny import make_tiny_tokenizer

H, HEADS, KV_HEADS, INTER, DRAFT_VOCAB, LAYERS = 64, 4, 2, 128, 128, 8
EOS = frozenset({2})
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
# format -> (boundary layers the head reads, as the target's layer inputs)
FORMATS = {"eagle": (2, 4, 5), "specforge": (1, 4, 6), "speculators": (1, 4, 6)}


@pytest.fixture(scope="module")
def target_hf():
    """8 layers: the default layers (2, L // 2, L - 3) are three distinct ones from 7 on."""
    return tiny_hf_model("llama-gqa", seed=0, logit_scale=3.0, num_hidden_layers=LAYERS)


def head_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head's tensors under the EAGLE authors' names (``midlayer.``)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.15):
        return torch.randn(*shape, generator=gen) * scale

    d = H // HEADS
    used = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values  # the draft's tokens
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[used] = True
    return {
        "midlayer.self_attn.q_proj.weight": rand(HEADS * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, HEADS * d),
        "midlayer.mlp.gate_proj.weight": rand(INTER, H),
        "midlayer.mlp.up_proj.weight": rand(INTER, H),
        "midlayer.mlp.down_proj.weight": rand(H, INTER),
        "midlayer.input_layernorm.weight": 1 + rand(H, scale=0.2),
        "midlayer.hidden_norm.weight": 1 + rand(H, scale=0.2),
        "midlayer.post_attention_layernorm.weight": 1 + rand(H, scale=0.2),
        "fc.weight": rand(H, 3 * H, scale=0.1),
        "norm.weight": 1 + rand(H, scale=0.2),
        "lm_head.weight": rand(DRAFT_VOCAB, H, scale=0.5),
        "d2t": used - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def layer_config() -> dict:
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1,
            "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}


def write_checkpoint(path, fmt: str, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (the EAGLE authors' names) as ``fmt`` writes them."""
    path.mkdir(parents=True)
    if fmt == "eagle":  # the authors' training export: pytorch_model.bin, no embedding
        config = {"architectures": ["LlamaForCausalLM"], **layer_config(),
                  "draft_vocab_size": DRAFT_VOCAB, "torch_dtype": "float16"}
        torch.save(tensors, path / "pytorch_model.bin")
    elif fmt == "specforge":  # save_pretrained: model.safetensors, ids as "output of layer i"
        config = {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(),
                  "draft_vocab_size": DRAFT_VOCAB,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5],
                                   "use_aux_hidden_state": True}}
        save_file(tensors, str(path / "model.safetensors"))
    else:  # speculators: layers.0., an embedding copy, the verifier named
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": layer_config(), "draft_vocab_size": DRAFT_VOCAB,
                  "norm_before_residual": True, "target_hidden_size": None,
                  "eagle_aux_hidden_state_layer_ids": [1, 4, 6],
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy",
                                                               "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": "tiny-llama",
                                                      "architectures": ["LlamaForCausalLM"]}}}
        renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        renamed["embed_tokens.weight"] = torch.zeros(VOCAB, H)  # ignored: the target's is used
        save_file(renamed, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_attention(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """Causal self-attention of a head's layer (``prefix``'s q/k/v/o) over positions 0..n-1,
    RoPE from the head's own config, written out: ``[n, H]``, after ``o_proj``."""
    n, d = x.shape[0], H // HEADS
    q = (x @ w[prefix + "self_attn.q_proj.weight"].T).view(n, HEADS, d)
    k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, d)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, d)
    cos, sin = rope_tables(LlamaConfig(**layer_config()), n)

    def rope(t):
        return t * cos[:, None] + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin[:, None]

    out = F.scaled_dot_product_attention(rope(q).transpose(0, 1), rope(k).transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True, enable_gqa=True)
    return out.transpose(0, 1).reshape(n, H) @ w[prefix + "self_attn.o_proj.weight"].T


def reference_mlp_block(h: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, eps: float) -> torch.Tensor:
    """``h`` plus the layer's MLP of its post-attention norm."""
    m = rms(h, w[prefix + "post_attention_layernorm.weight"], eps)
    return h + (F.silu(m @ w[prefix + "mlp.gate_proj.weight"].T) * (m @ w[prefix + "mlp.up_proj.weight"].T)
                ) @ w[prefix + "mlp.down_proj.weight"].T


def reference_logits(target_hf, tensors: dict[str, torch.Tensor], ids: list[int], layers,
                     norm_before_residual: bool, eps: float = 1e-5) -> torch.Tensor:
    """The published EAGLE-3 forward, written out from the formula: position t reads token
    t + 1 and fc(target states entering ``layers`` at t); full-vocabulary logits ``[n, V]``
    for positions 0..n-1 (n = len(ids) - 1), -inf off the draft vocabulary."""
    w = tensors
    with torch.no_grad():
        states = target_hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        n = len(ids) - 1
        g = torch.cat([states[i][0, :n] for i in layers], dim=-1)  # [n, 3H]
        f = g @ w["fc.weight"].T

        e = target_hf.model.embed_tokens(torch.tensor(ids[1:]))
        normed = rms(f, w["midlayer.hidden_norm.weight"], eps)
        a = torch.cat([rms(e, w["midlayer.input_layernorm.weight"], eps), normed], dim=-1)
        h = (normed if norm_before_residual else f) + reference_attention(a, w, "midlayer.")
        h = reference_mlp_block(h, w, "midlayer.", eps)
        small = rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
        full = torch.full((n, VOCAB), float("-inf"))
        full[:, torch.arange(len(w["d2t"])) + w["d2t"]] = small
        return full


def eagle1_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    """An EAGLE-1/2 head as the EAGLE authors publish it (``cnets1.py``): ``fc`` with its bias,
    one layer without an input norm, no final norm, no LM head."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.15):
        return torch.randn(*shape, generator=gen) * scale

    d = H // HEADS
    return {"fc.weight": rand(H, 2 * H, scale=0.1), "fc.bias": rand(H, scale=0.05),
            "layers.0.self_attn.q_proj.weight": rand(HEADS * d, H),
            "layers.0.self_attn.k_proj.weight": rand(KV_HEADS * d, H),
            "layers.0.self_attn.v_proj.weight": rand(KV_HEADS * d, H),
            "layers.0.self_attn.o_proj.weight": rand(H, HEADS * d),
            "layers.0.mlp.gate_proj.weight": rand(INTER, H), "layers.0.mlp.up_proj.weight": rand(INTER, H),
            "layers.0.mlp.down_proj.weight": rand(H, INTER),
            "layers.0.post_attention_layernorm.weight": 1 + rand(H, scale=0.2)}


def eagle1_reference(target_hf, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """EAGLE-1's forward from its formula: position t reads token t + 1 and the target's
    final (normed) hidden state at t; no input norm, no final norm, the target's LM head."""
    with torch.no_grad():
        n = len(ids) - 1
        f = target_hf.model(torch.tensor([ids])).last_hidden_state[0, :n]
        e = target_hf.model.embed_tokens(torch.tensor(ids[1:]))
        x = torch.cat([e, f], -1) @ w["fc.weight"].T + w["fc.bias"]
        x = reference_mlp_block(x + reference_attention(x, w, "layers.0."), w, "layers.0.", 1e-5)
        return target_hf.lm_head(x)


def test_a_published_eagle1_head_loads_and_drafts_what_its_formula_gives(target_hf, tmp_path):
    """``pytorch_model.bin`` and a plain Llama config (no ``bias`` key: ``fc`` has one)."""
    tensors = eagle1_tensors()
    (tmp_path / "head").mkdir()
    torch.save(tensors, tmp_path / "head" / "pytorch_model.bin")
    (tmp_path / "head" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                               **layer_config()}))
    assert read_draft_meta(tmp_path / "head") == {"kind": "eagle1", "format": "eagle1"}
    target = worker_of(target_hf).runtime
    head = load_draft_head(tmp_path / "head", target, max_model_len=256)
    assert head.kind == "eagle1" and target.feature_layers is None
    ids = list(range(5, 40, 3)) + [7, 9, 11]
    cache = target.make_cache(num_slots=1, max_seq_len=64)
    features = target(cache, ForwardBatch([cache.allocate()], [ids], hidden=True)).hidden
    n = len(ids) - 1
    head_cache = head.make_cache(num_slots=1, max_seq_len=64)
    logits = head(head_cache, ForwardBatch([head_cache.allocate()], [ids[1:]], [n],
                                           features=head.from_target(features[:n]), hidden=True)).logits
    ref = eagle1_reference(target_hf, tensors, ids)
    assert torch.allclose(logits, ref, atol=1e-4), (logits - ref).abs().max()
    # "bias": false with an fc.bias present says so in one line
    (tmp_path / "head" / "config.json").write_text(json.dumps({**layer_config(), "bias": False}))
    with pytest.raises(ConfigError, match="fc.bias is present"):
        load_draft_head(tmp_path / "head", target, max_model_len=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    tensors = head_tensors()
    for fmt in FORMATS:
        write_checkpoint(root / fmt, fmt, tensors)
    (root / "eagle1").mkdir()
    torch.save(eagle1_tensors(), root / "eagle1" / "pytorch_model.bin")
    (root / "eagle1" / "config.json").write_text(json.dumps(layer_config()))
    return root, tensors


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_published_head_loads_and_drafts_what_the_published_formula_gives(target_hf, checkpoints, fmt):
    root, tensors = checkpoints
    assert is_draft_dir(root / fmt) and read_draft_meta(root / fmt)["kind"] == "eagle3"
    target = worker_of(target_hf).runtime
    head = load_draft_head(root / fmt, target, max_model_len=256)
    assert head.kind == "eagle3" and head.target_layers == FORMATS[fmt]
    target.feature_layers = head.target_layers
    ids = list(range(5, 40, 3)) + [7, 9, 11]
    cache = target.make_cache(num_slots=1, max_seq_len=64)
    features = target(cache, ForwardBatch([cache.allocate()], [ids], hidden=True)).hidden
    assert features.shape == (len(ids), 3 * H)
    n = len(ids) - 1
    head_cache = head.make_cache(num_slots=1, max_seq_len=64)
    logits = head(head_cache, ForwardBatch([head_cache.allocate()], [ids[1:]], [n],
                                           features=head.from_target(features[:n]), hidden=True)).logits
    ref = reference_logits(target_hf, tensors, ids, FORMATS[fmt], norm_before_residual=fmt == "speculators")
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(logits), finite)
    assert torch.allclose(logits[finite], ref[finite], atol=1e-4), (logits[finite] - ref[finite]).abs().max()


@pytest.mark.parametrize("fmt", [*FORMATS, "eagle1"])
def test_a_published_head_serves_greedy_output_identical_to_target_only(target_hf, checkpoints, fmt):
    """Through the builder's loader (which points the target at the head's layers), chains
    and EAGLE-2 trees, a batch of 3."""
    root, _ = checkpoints
    prompts = [[5 + i, 9, 14 + i, 3, 8, 21 + 2 * i, 9, 14 + i] for i in range(3)]
    plain = SpecDecodeEngine(worker_of(target_hf), make_tiny_tokenizer(), eos_token_ids=EOS)
    reference = [c.output_token_ids for c in plain.generate(prompts, GREEDY)]
    for tree in (False, True):
        target = worker_of(target_hf)
        proposer = load_draft_proposer("eagle", ModelConfig(source=str(root / fmt)), num_slots=8,
                                       max_model_len=256, target_runtime=target.runtime,
                                       options={"tree": tree, "tree_topk": 2, "tree_depth": 3})
        assert isinstance(proposer, EagleProposer)
        assert target.runtime.feature_layers == FORMATS.get(fmt)  # eagle1: the final hidden states
        engine = SpecDecodeEngine(target, make_tiny_tokenizer(), eos_token_ids=EOS, proposer=proposer,
                                  num_speculative_tokens=3)
        got = engine.generate(prompts, GREEDY)
        assert [c.output_token_ids for c in got] == reference, (fmt, tree)
        assert engine.counters.spec.num_drafts > 0 and target.num_free_slots == 8


def test_a_head_that_does_not_match_the_target_says_what_differs(target_hf, checkpoints, tmp_path):
    root, tensors = checkpoints
    target = worker_of(target_hf).runtime
    cases = {
        "hidden": ({"target_hidden_size": 32}, {}, "hidden size 32"),
        "vocab": ({"vocab_size": 1000}, {}, "1000 tokens"),
        "layers": ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 9]}}, {}, "distinct layers"),
        "map": ({}, {"d2t": None}, "needs its map d2t"),
        "shape": ({}, {"fc.weight": torch.zeros(H, 2 * H)}, "fc.weight"),
        "tensor": ({}, {"midlayer.extra.weight": torch.zeros(3)}, "not supported"),
    }
    for name, (config_change, tensor_change, message) in cases.items():
        path = tmp_path / name
        changed = {k: v for k, v in {**tensors, **tensor_change}.items() if v is not None}
        write_checkpoint(path, "specforge", changed)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **config_change}))
        with pytest.raises(ConfigError, match=message) as info:
            load_draft_head(path, target, max_model_len=256)
        assert "\n" not in str(info.value), name
    # a speculators checkpoint of another algorithm
    path = tmp_path / "other"
    write_checkpoint(path, "speculators", tensors)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "speculators_model_type": "mlp"}))
    with pytest.raises(ConfigError, match="'mlp' is not supported"):
        load_draft_head(path, target, max_model_len=256)


def test_the_target_returns_its_final_hidden_states_unless_a_head_asks_for_layers(target_hf):
    """``feature_layers`` unset: the EAGLE-1 features (final, normed); set: the layer inputs,
    equal to ``transformers``' hidden states there."""
    target = worker_of(target_hf).runtime
    ids = list(range(3, 20))
    cache = target.make_cache(num_slots=2, max_seq_len=64)
    final = target(cache, ForwardBatch([cache.allocate()], [ids], hidden=True)).hidden
    assert final.shape == (len(ids), H)
    target.feature_layers = (1, 4, 6)
    layers = target(cache, ForwardBatch([cache.allocate()], [ids], hidden=True)).hidden
    with torch.no_grad():
        states = target_hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert torch.allclose(layers, torch.cat([states[i][0] for i in (1, 4, 6)], -1), atol=1e-4)
    assert torch.allclose(final, states[-1][0], atol=1e-4)  # transformers' last is normed


def test_a_units_groups_agree_on_the_layers_from_the_files(target_hf, checkpoints, tmp_path):
    """In a unit the target group and the draft group are apart: the target group reads the
    layers it returns from the head's config (``eagle3_target_layers``), the draft group
    loads the head on the target's embedding read from the target's files."""
    root, _ = checkpoints
    target_hf.generation_config.eos_token_id = 2
    target_hf.save_pretrained(tmp_path / "target")
    make_tiny_tokenizer().save_pretrained(tmp_path / "target")
    target_cfg = ModelConfig(source=str(tmp_path / "target"))
    draft = ModelConfig(source=str(root / "specforge"))
    cfg = EngineConfig(target=target_cfg, speculative=SpeculativeConfig(
        method="eagle", num_speculative_tokens=3, draft=draft))
    check_draft_files(cfg)  # no tokenizer in a published head: its vocabulary is checked on load
    assert eagle3_target_layers(cfg.speculative, LAYERS) == FORMATS["specforge"]
    proposer = load_draft_proposer("eagle", draft, num_slots=2, max_model_len=64, target_runtime=None,
                                   target_cfg=target_cfg)
    assert proposer.worker.runtime.target_layers == FORMATS["specforge"]
    assert eagle3_target_layers(SpeculativeConfig(method="ngram"), LAYERS) is None
    # an EAGLE-1 head drafts through the target's LM head, read from the target's files
    eagle1 = ModelConfig(source=str(root / "eagle1"))
    assert eagle3_target_layers(SpeculativeConfig(method="eagle", draft=eagle1), LAYERS) is None
    proposer = load_draft_proposer("eagle", eagle1, num_slots=2, max_model_len=64, target_runtime=None,
                                   target_cfg=target_cfg)
    assert torch.equal(proposer.worker.runtime.lm_head.weight, target_hf.lm_head.weight.detach())


def test_an_agreeing_head_is_accepted_and_output_stays_identical(tmp_path):
    """A head that drafts the target's tokens about half the time (``speculators``, a full
    draft vocabulary without ``d2t``, extra plain layers): accepted drafts bring the target's
    features of the kept tokens back to the head; chains and trees."""
    hf = tiny_hf_model("llama-mha", seed=0, logit_scale=3.0)
    write_agreeing_eagle3_head(hf, tmp_path / "head")
    prompts = [[5 + i, 9, 14 + i, 3, 8, 21 + 2 * i, 9, 14 + i] for i in range(3)]
    plain = SpecDecodeEngine(worker_of(hf), make_tiny_tokenizer(), eos_token_ids=EOS)
    reference = [c.output_token_ids for c in plain.generate(prompts, GREEDY)]
    for tree in (False, True):
        target = worker_of(hf)
        proposer = load_draft_proposer("eagle", ModelConfig(source=str(tmp_path / "head")), num_slots=8,
                                       max_model_len=256, target_runtime=target.runtime,
                                       options={"tree": tree})
        engine = SpecDecodeEngine(target, make_tiny_tokenizer(), eos_token_ids=EOS, proposer=proposer,
                                  num_speculative_tokens=3)
        assert [c.output_token_ids for c in engine.generate(prompts, GREEDY)] == reference, tree
        spec = engine.counters.spec
        assert spec.num_accepted_tokens >= spec.num_draft_tokens // 8, spec


def test_a_head_by_hub_id_is_read_from_the_hub_cache(target_hf, checkpoints, tmp_path, monkeypatch):
    """``draft.source: org/name``: downloaded once into the hub cache, then read from it. No
    network here: the cache is laid out as a download leaves it and the hub is offline."""
    import huggingface_hub.constants as hub
    from specserve.engine.drafts import draft_head

    root, _ = checkpoints
    cache = tmp_path / "hub"
    for repo, fmt in (("org/eagle3-head", "speculators"), ("org/eagle1-head", "eagle1"),
                      ("org/plain", None)):
        folder = cache / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("0" * 40)
        if fmt is None:  # a plain model's config: not a head, left to the model loader
            (snapshot / "config.json").write_text(json.dumps({**layer_config(), "num_hidden_layers": 2}))
            continue
        for file in (root / fmt).iterdir():
            (snapshot / file.name).write_bytes(file.read_bytes())
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    draft_head.hub_head.cache_clear()
    target = worker_of(target_hf).runtime
    assert read_draft_meta("org/eagle3-head")["format"] == "speculators"
    head = load_draft_head("org/eagle3-head", target, max_model_len=64)
    assert head.target_layers == FORMATS["speculators"]
    assert load_draft_head("org/eagle1-head", target, max_model_len=64).kind == "eagle1"
    assert not is_draft_dir("org/plain") and not is_draft_dir("org/absent")
    draft_head.hub_head.cache_clear()


def test_the_library_kernels_return_the_same_layer_states_at_a_fixed_head_shape(target_hf):
    """The GPU path (``library``; on CUDA a decode and a verify run the head at one padded
    shape, emulated here by setting that width): the layer states match the C kernels'."""
    ours = worker_of(target_hf).runtime
    library = worker_of(target_hf).runtime.use_kernels("library")
    library.decode_width = 4  # what use_kernels sets on CUDA (verify_tokens)
    got = {}
    for name, rt in (("invariant", ours), ("library", library)):
        rt.feature_layers = FORMATS["eagle"]
        cache = rt.make_cache(num_slots=1, max_seq_len=64)
        slot = cache.allocate()
        rt(cache, ForwardBatch([slot], [list(range(3, 30))]))
        got[name] = rt(cache, ForwardBatch([slot], [[5, 6, 7, 8]], [4], hidden=True))  # a verify of 4
    assert torch.allclose(got["invariant"].logits, got["library"].logits, atol=1e-4)
    assert got["library"].hidden.shape == (4, 3 * H)
    assert torch.allclose(got["invariant"].hidden, got["library"].hidden, atol=1e-4)
