"""Sampling: one step's logits into next tokens: penalties, structured-output grammars and their
masks, min_tokens, then greedy / temperature / top-k / top-p with per-request seeds. Imports torch;
nothing from the scheduler side beyond the per-request sampling state."""
