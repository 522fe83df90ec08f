"""Training trained drafters (`specula train`): self-distillation corpus, cached target features,
the head training loop and its held-out acceptance report. See docs/training.md."""
