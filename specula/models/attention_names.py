"""The names of the attention implementations (`--attn`, `LoadConfig.attn_implementation`), apart
from `attention` (which registers with transformers) so that building the command line imports
neither torch nor transformers (`specula --help` and `specula cache info` took 7.5 s doing so), and
a load of a prepared native model needs no transformers model code (5.3 s of imports)."""

BATCH_INVARIANT = "specula_batch_invariant"
"""The name registered with transformers (users pass `batch_invariant`)."""

ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "batch_invariant")
"""Values of `--attn` / `LoadConfig.attn_implementation`. `auto`: batch_invariant for an int8 model
(whose activation rounding needs it to stay lossless), sdpa otherwise."""


def resolve_attention(attn_implementation: str, quantize: str = "none") -> str:
    """One of `ATTN_IMPLEMENTATIONS` with `auto` decided (see there); unknown names are refused."""
    from specula.errors import ConfigError

    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"unknown attention implementation {attn_implementation!r}; "
                          f"choose one of: {', '.join(ATTN_IMPLEMENTATIONS)}")
    if attn_implementation == "auto":
        return "sdpa" if quantize == "none" else "batch_invariant"
    return attn_implementation
