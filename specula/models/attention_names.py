"""The names of the attention implementations (`--attn`, `LoadConfig.attn_implementation`), apart
from `attention` (which registers with transformers) so that building the command line imports
neither torch nor transformers: `specula --help` and `specula cache info` took 7.5 s doing so."""

BATCH_INVARIANT = "specula_batch_invariant"
"""The name registered with transformers (users pass `batch_invariant`)."""

ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "batch_invariant")
"""Values of `--attn` / `LoadConfig.attn_implementation`. `auto`: batch_invariant for an int8 model
(whose activation rounding needs it to stay lossless), sdpa otherwise."""
