"""Self-distillation of a draft on the target's own outputs (the ``train-draft`` loop).

Loss per position, over the draft vocabulary (the target's distribution there, renormalised):

- ``kl``: KL(p_target || q_draft), the target's soft labels from its LM head applied to its
  stored features. Matching the whole distribution, not only the argmax, is what keeps sampled
  acceptance up too.
- ``eagle`` also regresses the next feature (smooth L1, as EAGLE does) and adds noise to the
  input features (EAGLE's augmentation: at serving time the head's own, imperfect features come
  back in). With ``unroll`` = 2 it trains a second pass whose input features are the first
  pass's predictions (a cheap form of EAGLE-3's training-time test: drafts 2..K read predicted
  features, and a head trained only on real ones drifts).
- ``eagle3`` reads the target's low, middle and high layer states, fused by its ``fc``
  (trained with it), and is trained on the token distribution alone (EAGLE-3 drops the
  feature regression: the head's features need not imitate the target's); its later passes
  read its own pre-norm outputs, as it does when it drafts. A sample's stored features are
  those layer states followed by the target's final hidden state (the soft labels).

Batches are sequences of similar length, up to ``batch_tokens`` tokens; AdamW with warm-up
and cosine decay; a checkpoint (weights, optimizer, step) every ``checkpoint_every`` steps and
at the end, so a rerun resumes where it stopped. Everything is seeded.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.engine.drafts.draft_head import DraftHead, trainable_state
from specserve.errors import ConfigError
from specserve.training.data import Sample
from specserve.training.options import TrainConfig


def batches(samples: list[Sample], batch_tokens: int, max_len: int, seed: int) -> list[list[int]]:
    """Indices of ``samples`` grouped by length (so little padding), in a seeded order."""
    order = sorted(range(len(samples)), key=lambda i: min(samples[i].num_tokens, max_len))
    out, cur = [], []
    for i in order:
        longest = min(samples[i].num_tokens, max_len)
        if cur and longest * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    random.Random(seed).shuffle(out)
    return out


def data_key(samples: list[Sample]) -> str:
    """A fingerprint of the training sequences: a checkpoint resumes only on the same data."""
    h = hashlib.sha1()
    for s in samples:
        h.update(torch.tensor(s.token_ids, dtype=torch.int64).numpy().tobytes())
        h.update(s.prompt_len.to_bytes(4, "little"))
    return h.hexdigest()[:16]


def collate(samples: list[Sample], max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens [B, T]``, ``features [B, T - 1, H]`` (float32), ``lengths [B]`` (right padded).
    ``Sample.prompt_len`` is read by the loss weights (:meth:`Trainer.losses`)."""
    seqs = [s.token_ids[:max_len] for s in samples]
    t = max(len(s) for s in seqs)
    hidden = samples[0].features.shape[-1]
    tokens = torch.zeros(len(seqs), t, dtype=torch.long)
    feats = torch.zeros(len(seqs), t - 1, hidden)
    for i, (s, ids) in enumerate(zip(samples, seqs)):
        tokens[i, :len(ids)] = torch.tensor(ids)
        n = min(len(ids) - 1, len(s.features))
        feats[i, :n] = s.features[:n].float()
    return tokens, feats, torch.tensor([len(ids) for ids in seqs])


class Trainer:
    """Trains ``head`` against the target LM head rows ``target_head`` ([draft_vocab, H])."""

    def __init__(self, head: DraftHead, target_head: torch.Tensor, cfg: TrainConfig,
                 work_dir: Path) -> None:
        self.head, self.cfg = head, cfg
        self.target_head = target_head.detach().float()
        self.ckpt = work_dir / "checkpoints" / "last.pt"
        head.lm_head.weight.requires_grad_(cfg.train_lm_head)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.data_key = ""
        self.feature_std: torch.Tensor | None = None
        # eagle3: the stored features' first ``split`` dims are the head's input, the rest the
        # target's final hidden state
        self.split = head.fc.in_features if head.kind == "eagle3" else None

    def fit(self, train: list[Sample], *, progress: bool = True) -> dict:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        if self.head.uses_features:
            self.feature_std = torch.cat([s.features[:256, :self.split].float() for s in train[:64]]).std(0)
        plan = [batches(train, cfg.batch_tokens, cfg.max_len, cfg.seed + e) for e in range(cfg.epochs)]
        total = sum(len(p) for p in plan)
        self.data_key = data_key(train)
        self._resume()
        self.head.train()
        history: list[dict] = []
        with tqdm(total=total, initial=self.step, desc="train", unit="step", disable=not progress) as bar:
            for epoch, epoch_batches in enumerate(plan):
                done_before = sum(len(p) for p in plan[:epoch])
                for b, idx in enumerate(epoch_batches):
                    if done_before + b < self.step:
                        continue  # resumed past it
                    torch.manual_seed(cfg.seed * 1_000_003 + self.step)  # resume-exact noise
                    metrics = self._train_step([train[i] for i in idx], total)
                    self.step += 1
                    history.append(metrics)
                    bar.update(1)
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['top1']:.3f}")
                    if self.step % cfg.checkpoint_every == 0:
                        self._save()
        self._save()
        self.head.eval()
        tail = history[-max(1, len(history) // 10):] or [{"loss": float("nan"), "top1": float("nan")}]
        return {"steps": self.step, "final_loss": sum(m["loss"] for m in tail) / len(tail),
                "final_top1": sum(m["top1"] for m in tail) / len(tail), "config": asdict(cfg)}

    def _lr(self, total: int) -> float:
        cfg = self.cfg
        if self.step < cfg.warmup_steps:
            return cfg.lr * (self.step + 1) / cfg.warmup_steps
        progress = (self.step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def _train_step(self, samples: list[Sample], total: int) -> dict:
        for group in self.opt.param_groups:
            group["lr"] = self._lr(total)
        loss, top1 = self.losses(samples)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return {"loss": float(loss.detach()), "top1": top1}

    def losses(self, samples: list[Sample]) -> tuple[torch.Tensor, float]:
        """The batch loss and the top-1 agreement with the target (over the draft vocabulary)."""
        tokens, feats, lengths = collate(samples, self.cfg.max_len)
        prompt_lens = torch.tensor([s.prompt_len for s in samples])
        if self.split is not None:
            return self._eagle3_losses(tokens, feats, lengths, prompt_lens)
        if self.head.uses_features:
            return self._eagle_losses(tokens, feats, lengths, prompt_lens)
        # decoder: position t reads x_t and should give the target's distribution after it
        # (the distribution of x_{t+1}: an answer token from t = prompt_len - 1 on).
        t = feats.shape[1]
        hidden = self.head.train_forward(tokens[:, :t])
        weights = self._weights(t, lengths - 1, prompt_lens - 1)
        mask = weights > 0
        return self._kl(hidden[mask], feats[mask], weights[mask])

    def _weights(self, t: int, valid: torch.Tensor, answer_from: torch.Tensor) -> torch.Tensor:
        """``[B, t]`` loss weights: 0 past ``valid``, 1 from ``answer_from`` on, else
        ``prompt_weight`` (what a draft serves is answers; prompts still teach language)."""
        pos = torch.arange(t)[None]
        weights = torch.where(pos >= answer_from[:, None], 1.0, self.cfg.prompt_weight)
        return weights * (pos < valid[:, None])

    def _eagle_losses(self, tokens, feats, lengths, prompt_lens) -> tuple[torch.Tensor, float]:
        # Position t reads (x_{t+1}, f_t) and should predict f_{t+1}, whose logits give the
        # distribution of x_{t+2}: t in [0, T - 2), answers from t = prompt_len - 2 on.
        t = feats.shape[1] - 1
        inputs, target = feats[:, :t], feats[:, 1:t + 1]
        weights = self._weights(t, lengths - 2, prompt_lens - 2)
        mask = weights > 0
        noise = torch.randn_like(inputs) * self.feature_std * self.cfg.feature_noise
        hidden = self.head.train_forward(tokens[:, 1:t + 1], inputs + noise)
        loss, top1 = self._eagle_terms(hidden, target, mask, weights)
        weight = 1.0
        for _ in range(1, self.cfg.unroll):
            # The next pass reads, at t, the feature the previous pass predicted for t.
            predicted = torch.cat([inputs[:, :1], hidden[:, :-1]], dim=1)
            hidden = self.head.train_forward(tokens[:, 1:t + 1], predicted)
            term, _ = self._eagle_terms(hidden, target, mask, weights)
            weight *= 0.5
            loss = loss + weight * term
        return loss, top1

    def _eagle3_losses(self, tokens, feats, lengths, prompt_lens) -> tuple[torch.Tensor, float]:
        # As _eagle_losses, position t reads (x_{t+1}, fc(g_t)); its output, normed, should
        # give the target's distribution of x_{t+2} (from the final hidden state at t + 1).
        t = feats.shape[1] - 1
        layers, soft = feats[:, :t, :self.split], feats[:, 1:t + 1, self.split:]
        weights = self._weights(t, lengths - 2, prompt_lens - 2)
        mask = weights > 0
        noise = torch.randn_like(layers) * self.feature_std * self.cfg.feature_noise
        fused = self.head.from_target(layers + noise)
        out = self.head.train_forward(tokens[:, 1:t + 1], fused, prenorm=True)
        loss, top1 = self._kl(self.head.final_norm(out)[mask], soft[mask], weights[mask])
        weight = 1.0
        for _ in range(1, self.cfg.unroll):
            # The next pass reads, at t, the head's own output at t - 1 (as when it drafts).
            out = self.head.train_forward(tokens[:, 1:t + 1], torch.cat([fused[:, :1], out[:, :-1]], dim=1),
                                          prenorm=True)
            term, _ = self._kl(self.head.final_norm(out)[mask], soft[mask], weights[mask])
            weight *= 0.5
            loss = loss + weight * term
        return loss, top1

    def _eagle_terms(self, hidden, target, mask, weights) -> tuple[torch.Tensor, float]:
        w = weights[mask]
        kl, top1 = self._kl(hidden[mask], target[mask], w)
        reg = (F.smooth_l1_loss(hidden[mask], target[mask], reduction="none").mean(-1) * w).sum() / w.sum()
        return kl + self.cfg.reg_weight * reg, top1

    def _kl(self, hidden: torch.Tensor, target_feats: torch.Tensor,
            weights: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Weighted mean KL(p || q) over the draft vocabulary (``[N, H]`` inputs), and the
        top-1 agreement on answer positions (weight 1)."""
        with torch.no_grad():
            p_logits = target_feats @ self.target_head.T  # [N, n]
            p = torch.softmax(p_logits, dim=-1)
        q_log = torch.log_softmax(self.head.lm_head(hidden).float(), dim=-1)
        kl = ((p * (torch.log(p.clamp_min(1e-30)) - q_log)).sum(-1) * weights).sum() / weights.sum()
        answers = weights == 1.0
        hits = (q_log.argmax(-1) == p_logits.argmax(-1))[answers]
        top1 = float(hits.float().mean()) if answers.any() else 0.0
        return kl, top1

    def _save(self) -> None:
        self.ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save({"step": self.step, "model": trainable_state(self.head), "data": self.data_key,
                    "optimizer": self.opt.state_dict(), "config": asdict(self.cfg)}, tmp)
        tmp.replace(self.ckpt)

    def _resume(self) -> None:
        if not self.ckpt.is_file():
            return
        state = torch.load(self.ckpt)
        if state["config"] != asdict(self.cfg) or state.get("data") != self.data_key:
            raise ConfigError(f"checkpoint {self.ckpt} was made with other settings or data; "
                              "delete it to start over, or use another --work-dir")
        model = {k: v for k, v in state["model"].items() if k != "draft_vocab"}
        self.head.load_state_dict(model, strict=False)
        self.opt.load_state_dict(state["optimizer"])
        self.step = state["step"]
