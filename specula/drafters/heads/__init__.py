"""Trained drafter heads on the target's hidden states: EAGLE (feature-level autoregression),
Medusa (independent residual heads per offset) and Hydra (heads that also see the tokens drafted
before them). `config` holds their shape, `eagle` / `medusa` the modules, `file` the checked
on-disk format, `state` the per-request drafting state the `draft-tree` expansion drives."""
