"""specula: lossless speculative decoding for Hugging Face causal language models."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

GOMP_SPINCOUNT = "10000"
"""OpenMP's idle spin (libgomp's `GOMP_SPINCOUNT`) set for this process when specula is imported
before torch and the user set neither it nor `OMP_WAIT_POLICY`. torch's OpenMP workers otherwise
spin ~300,000 rounds after every parallel torch op, on the core that specula's kernel pool
(`models/native/kernels/pool.c`) needs next: on the 2-core development machine, SmolLM2 tree
passes of 4-8 tokens took 31.5 / 44.6 ms with the default spin and 26-27 / 37-40 ms with this one
(the OpenMP kernels of before: 25.4 / 37.4 ms); Hugging Face `generate` took 1.31-1.47 s for 32
tokens against 1.28-1.38 s (3-6%, within this machine's run-to-run spread; `OMP_WAIT_POLICY=passive`
made it 38% slower)."""

_spin_unset = not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(_os.environ)
OPENMP_SPIN_UNSET = "torch" in _sys.modules and _spin_unset
"""Whether torch was imported before specula with neither variable set: its OpenMP workers then
keep libgomp's default spin (read once, when torch loads), and the native CPU backend warns
(`models.native.kernels.openmp_spin_warning`)."""

if "torch" not in _sys.modules and _spin_unset:
    _os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT
