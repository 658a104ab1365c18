"""Build a :class:`SpecDecodeEngine` from an :class:`~specserve.config.EngineConfig`."""

from __future__ import annotations

from specserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from specserve.engine.adaptive import SpecLengthController
from specserve.engine.draft_head import is_draft_dir, load_draft_head
from specserve.engine.loader import (
    LoadedModel,
    load_model,
    resolve_device,
    resolve_dtype,
)
from specserve.engine.proposers.base import Proposer
from specserve.engine.proposers.draft_model import DraftModelProposer
from specserve.engine.proposers.eagle import EagleProposer
from specserve.engine.proposers.hybrid import NgramFirstProposer
from specserve.engine.proposers.ngram import NgramProposer
from specserve.engine.spec_decode import SpecDecodeEngine
from specserve.engine.worker import ModelWorker
from specserve.errors import ConfigError


def build_proposer(spec: SpeculativeConfig, target: LoadedModel, *, num_slots: int,
                   max_model_len: int) -> Proposer | None:
    if spec.method is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)
    model = load_draft_proposer(spec.method, spec.draft, target_runtime=target.runtime,
                                num_slots=num_slots, max_model_len=max_model_len)
    return with_ngram_first(spec, model)


def with_ngram_first(spec: SpeculativeConfig, model: Proposer) -> Proposer:
    """``model``, behind prompt lookup when ``speculative.ngram_first`` asks for it."""
    if not spec.ngram_first:
        return model
    return NgramFirstProposer(model, min_n=max(2, spec.prompt_lookup_min),
                              max_n=max(2, spec.prompt_lookup_max))


def load_draft_proposer(method: str, draft_cfg: ModelConfig, *, num_slots: int, max_model_len: int,
                        target_runtime=None, target_cfg: ModelConfig | None = None,
                        target_vocab_size: int | None = None) -> Proposer:
    """The proposer of a model method: a plain draft model, or a draft from ``train-draft``
    (a directory with ``draft.json``) on the target's embeddings, taken from
    ``target_runtime`` when the target is in this process, else read via ``target_cfg``.
    ``target_vocab_size`` (default: ``target_runtime``'s): the ids the target verifies; a
    plain draft with more or fewer embedding rows drafts over exactly those."""
    if is_draft_dir(draft_cfg.source):
        device = resolve_device(draft_cfg.device)
        head = load_draft_head(draft_cfg.source, target_runtime, target_cfg=target_cfg,
                               max_model_len=max_model_len, device=device,
                               dtype=resolve_dtype(draft_cfg.dtype, device))
        worker = ModelWorker(head, num_slots=num_slots, max_seq_len=max_model_len)
        if (method == "eagle") != head.uses_features:
            raise ConfigError(f"a {head.kind!r} draft cannot serve method {method}")
        return EagleProposer(worker) if head.uses_features else DraftModelProposer(worker)
    if method == "eagle":
        raise ConfigError("method eagle needs an 'eagle' draft made by `specserve train-draft`")
    draft = load_model(draft_cfg, max_model_len=max_model_len)
    # The config's same-tokenizer check makes the ids mean the same strings; the embedding
    # tables may still differ in padding, which the proposer maps (draft_model.py).
    if target_vocab_size is None and target_runtime is not None:
        target_vocab_size = target_runtime.arch.vocab_size
    return DraftModelProposer(ModelWorker(draft.runtime, num_slots=num_slots, max_seq_len=max_model_len),
                              target_vocab_size=target_vocab_size)


def build_engine(cfg: EngineConfig) -> tuple[SpecDecodeEngine, LoadedModel]:
    """The engine and the loaded target (its name and tokenizer serve the API)."""
    target = load_model(cfg.target, max_model_len=cfg.max_model_len)
    worker = ModelWorker(target.runtime, num_slots=cfg.max_num_seqs, max_seq_len=cfg.max_model_len)
    proposer = build_proposer(cfg.speculative, target, num_slots=cfg.max_num_seqs,
                              max_model_len=cfg.max_model_len)
    engine = SpecDecodeEngine(worker, target.tokenizer, eos_token_ids=target.eos_token_ids,
                              proposer=proposer,
                              num_speculative_tokens=cfg.speculative.num_speculative_tokens,
                              controller=build_controller(cfg.speculative))
    return engine, target


def build_controller(spec: SpeculativeConfig) -> SpecLengthController | None:
    """The per-step K controller (used by requests added with ``adaptive=True``)."""
    if spec.method is None or not spec.adaptive.enabled:
        return None
    return SpecLengthController(spec.num_speculative_tokens, spec.adaptive)
