"""Training drafts for a target (``specserve train-draft``): prompts, the target's own answers
as data (self-distillation), training an EAGLE head or a small decoder, and evaluating its
acceptance (docs/DRAFTS.md)."""
