"""Build a :class:`SpecDecodeEngine` from an :class:`~specserve.config.EngineConfig`.

Everything that assembles an engine goes through here: ``specserve generate`` and the
benchmarks in one process (:func:`build_engine`), a Serve unit around its remote target and
draft groups (:func:`assemble_engine`), a draft group's actor (:func:`load_draft_proposer`).
The checks that read files (:func:`check_draft_files`) live here too, not in the config:
they run before an engine loads a model, and once before Ray starts (``deploy/app.py``).
"""

from __future__ import annotations

from specserve.config import EngineConfig, KVCacheConfig, ModelConfig, SpeculativeConfig
from specserve.engine.drafts.base import Proposer
from specserve.engine.drafts.draft_head import (
    draft_path,
    is_draft_dir,
    load_draft_head,
    published,
    read_draft_meta,
    serves,
)
from specserve.engine.drafts.hybrid import HybridProposer
from specserve.engine.loader import (
    LoadedModel,
    ResolvedSource,
    load_model,
    load_tokenizer,
    resolve,
    resolve_device,
    resolve_dtype,
)
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.step.adaptive import SpecLengthController
from specserve.engine.worker import ModelWorker
from specserve.errors import ConfigError
from specserve.methods import PROPOSERS, proposer_class


def check_draft_files(cfg: EngineConfig) -> None:
    """Refuse a draft that cannot serve: another tokenizer than the target's, or a draft
    made by ``train-draft`` of a kind its method does not take. Reads the tokenizers and
    ``draft.json``; a config without a draft passes."""
    draft = cfg.speculative.draft
    if draft is None:
        return
    check_same_tokenizer(cfg.target, draft)
    check_draft_kind(cfg.speculative.method, draft)


def check_draft_kind(method: str, draft: ModelConfig) -> None:
    """A method takes drafts of its registry ``draft_kind`` (and plain models where its
    ``plain_draft`` says so: draft_model)."""
    spec = PROPOSERS[method]
    kind = read_draft_meta(draft.source)["kind"] if is_draft_dir(draft.source) else None
    if serves(kind) != spec.draft_kind and not (kind is None and spec.plain_draft):
        raise ConfigError(f"method {method} needs a {spec.draft_kind!r} draft from `specserve "
                          f"train-draft`; {draft.source!r} is "
                          f"{'a ' + repr(kind) + ' draft' if kind else 'a plain model'}")


def check_same_tokenizer(target: ModelConfig, draft: ModelConfig) -> None:
    """Refuse a draft whose vocabulary differs from the target's: its token ids would mean
    other strings, and verification would compare unrelated tokens. A published EAGLE head
    ships no tokenizer: its vocabulary size is checked against the target's when it loads."""
    if published(draft.source) is not None:
        return
    # The draft first: a draft path that does not exist is refused before the target's GGUF
    # is converted (minutes on a large model, and progress bars around a one-line error).
    draft_src = (ResolvedSource(draft.source, str(draft_path(draft.source))) if is_draft_dir(draft.source)
                 else resolve(draft.source, draft.cache_dir))
    target_vocab = load_tokenizer(resolve(target.source, target.cache_dir)).get_vocab()
    draft_vocab = load_tokenizer(draft_src).get_vocab()
    if target_vocab != draft_vocab:
        raise ConfigError(
            f"draft {draft.source!r} does not share the target's tokenizer "
            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, or different ids)")


def build_proposer(spec: SpeculativeConfig, draft: Proposer | None = None) -> Proposer | None:
    """The proposer ``spec`` asks for. ``draft``: the model proposer of a method that needs
    one, loaded by :func:`load_draft_proposer` or a unit's remote draft group."""
    if spec.method is None:
        return None
    if not PROPOSERS[spec.method].draft_model:
        return proposer_class(spec.method).from_config(spec)
    assert draft is not None, f"method {spec.method} needs its draft model"
    if spec.first_method is None:
        return draft
    return HybridProposer(proposer_class(spec.first_method).from_config(spec), draft)


def load_draft_proposer(method: str, draft_cfg: ModelConfig, *, num_slots: int, max_model_len: int,
                        target_runtime=None, target_cfg: ModelConfig | None = None,
                        target_vocab_size: int | None = None, options: dict | None = None,
                        kv: KVCacheConfig | None = None) -> Proposer:
    """The proposer of a model method: a plain draft model, or a draft from ``train-draft``
    (a directory with ``draft.json``) on the target's embeddings, taken from
    ``target_runtime`` when the target is in this process, else read via ``target_cfg``.
    ``target_vocab_size`` (default: ``target_runtime``'s): the ids the target verifies; a
    plain draft with more or fewer embedding rows drafts over exactly those. ``options``:
    the method's ``speculative.<method>`` settings (``SpeculativeConfig.method_options``);
    ``kv``: the draft's cache layout (``EngineConfig.draft_kv_cache``; None: slots)."""
    spec = PROPOSERS[method]
    if is_draft_dir(draft_cfg.source):
        device = resolve_device(draft_cfg.device)
        head = load_draft_head(draft_cfg.source, target_runtime, target_cfg=target_cfg,
                               max_model_len=max_model_len, device=device,
                               dtype=resolve_dtype(draft_cfg.dtype, device),
                               kernels=draft_cfg.kernels)
        if serves(head.kind) != spec.draft_kind:
            raise ConfigError(f"a {head.kind!r} draft cannot serve method {method}")
        if head.kind == "eagle3" and target_runtime is not None:
            # the target returns those layers' states as its features (a unit's target group
            # sets them itself: eagle3_target_layers)
            target_runtime.feature_layers = head.target_layers
        runtime = head
    elif spec.plain_draft:
        runtime = load_model(draft_cfg, max_model_len=max_model_len, draft=True).runtime
    else:
        raise ConfigError(f"method {method} needs a {spec.draft_kind!r} draft made by "
                          "`specserve train-draft`")
    # check_draft_files makes the ids mean the same strings; the embedding tables may still
    # differ in padding, which the proposer maps (draft_model.py).
    if target_vocab_size is None and target_runtime is not None:
        target_vocab_size = target_runtime.arch.vocab_size
    worker = ModelWorker(runtime, num_slots=num_slots, max_seq_len=max_model_len, kv=kv)
    return proposer_class(method).from_draft(worker, target_vocab_size=target_vocab_size,
                                             options=options)


def assemble_engine(target, tokenizer, eos_token_ids: frozenset[int], spec: SpeculativeConfig,
                    draft: Proposer | None = None, *,
                    chunked_prefill_size: int | None = None) -> SpecDecodeEngine:
    """The engine over a target (an in-process ``ModelWorker`` or a unit's target group),
    with the proposer and K controller ``spec`` asks for (``draft``: see :func:`build_proposer`)
    and a step's token budget (chunked prefill; None: prompts whole)."""
    return SpecDecodeEngine(target, tokenizer, eos_token_ids=eos_token_ids,
                            proposer=build_proposer(spec, draft),
                            num_speculative_tokens=spec.num_speculative_tokens,
                            controller=build_controller(spec),
                            chunked_prefill_size=chunked_prefill_size)


def build_engine(cfg: EngineConfig) -> tuple[SpecDecodeEngine, LoadedModel]:
    """The engine, in this process, and the loaded target (its name and tokenizer serve the API)."""
    check_draft_files(cfg)
    spec = cfg.speculative
    target = load_model(cfg.target, max_model_len=cfg.max_model_len)
    cfg = cfg.for_device(str(target.runtime.embed.weight.device))
    worker = ModelWorker(target.runtime, num_slots=cfg.max_num_seqs, max_seq_len=cfg.max_model_len,
                         kv=cfg.kv_cache)
    draft = None
    if spec.method is not None and PROPOSERS[spec.method].draft_model:
        draft = load_draft_proposer(spec.method, spec.draft, target_runtime=target.runtime,
                                    num_slots=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                                    options=spec.method_options, kv=cfg.draft_kv_cache)
    return assemble_engine(worker, target.tokenizer, target.eos_token_ids, spec, draft,
                           chunked_prefill_size=cfg.chunked_prefill_size), target


def build_controller(spec: SpeculativeConfig) -> SpecLengthController | None:
    """The per-step K controller (used by requests added with ``adaptive=True``)."""
    if spec.method is None or not spec.adaptive.enabled:
        return None
    return SpecLengthController(spec.num_speculative_tokens, spec.adaptive)
