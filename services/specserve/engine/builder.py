"""Build a :class:`SpecDecodeEngine` from an :class:`~specserve.config.EngineConfig`."""

from __future__ import annotations

from specserve.config import EngineConfig, SpeculativeConfig
from specserve.engine.adaptive import SpecLengthController
from specserve.engine.loader import LoadedModel, load_model
from specserve.engine.proposers.base import Proposer
from specserve.engine.proposers.draft_model import DraftModelProposer
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
    draft = load_model(spec.draft, max_model_len=max_model_len)
    if draft.runtime.arch.vocab_size != target.runtime.arch.vocab_size:
        raise ConfigError(f"draft vocabulary size {draft.runtime.arch.vocab_size} differs from the "
                          f"target's {target.runtime.arch.vocab_size}")
    return DraftModelProposer(ModelWorker(draft.runtime, num_slots=num_slots,
                                          max_seq_len=max_model_len))


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
