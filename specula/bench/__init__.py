"""Benchmarks: Spec-Bench (or your prompts) through every method and Hugging Face `generate`
peers in one process, with results.json, report.md, plots and the target's cost curve.

    from specula.bench import run_bench, load_prompts, select_prompts
"""

from specula.bench.datasets import BenchPrompt, load_prompts, select_prompts
from specula.bench.methods import BenchMethod, MethodOutput, SpeculaMethod, build_specula_methods
from specula.bench.peers import HFPeer, build_peers
from specula.bench.runner import BenchResult, BenchSettings, run_bench

__all__ = [
    "BenchMethod", "BenchPrompt", "BenchResult", "BenchSettings", "HFPeer", "MethodOutput",
    "SpeculaMethod", "build_peers", "build_specula_methods", "load_prompts", "run_bench",
    "select_prompts",
]
