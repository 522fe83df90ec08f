"""The llama.cpp peer: a missing llama-cpp-python is a one-line error with the install command,
and a fake llama_cpp module shows what the peer asks of it (token ids in, greedy, reset, EOS)."""

from __future__ import annotations

import sys
import types

import pytest

from specula.bench.llamacpp import LlamaCppPeer, gguf_of
from specula.bench.peers import parse_compare
from specula.errors import ConfigError
from specula.sampling import SamplingParams


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(ConfigError, match=r"pip install 'specula\[llamacpp\]'"):
        parse_compare("hf,llamacpp", has_draft=False)
    assert parse_compare("hf", has_draft=False) == ["hf:greedy", "hf:prompt-lookup"]


def test_gguf_of_refuses_what_is_not_a_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert gguf_of(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    with pytest.raises(ConfigError, match="GGUF files"):
        gguf_of(str(tmp_path))


def test_peer_drives_llama_cpp_greedily_from_token_ids(monkeypatch, tmp_path):
    calls = {}

    class FakeLlama:
        def __init__(self, model_path, **kwargs):
            calls["init"] = (model_path, kwargs)

        def reset(self):
            calls["reset"] = calls.get("reset", 0) + 1

        def generate(self, tokens, **kwargs):
            calls["generate"] = (tokens, kwargs)
            yield from [5, 6, 2, 7]

    fake = types.ModuleType("llama_cpp")
    fake.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    peer = LlamaCppPeer("llamacpp", tmp_path / "m.gguf", eos_token_ids=[2], threads=2)
    out = peer.generate([1, 2, 3], SamplingParams(max_new_tokens=10))
    assert out.token_ids == [5, 6, 2] and out.stats is None and out.seconds >= 0
    assert calls["generate"][0] == [1, 2, 3] and calls["generate"][1]["temp"] == 0.0
    assert calls["init"][1]["n_threads"] == 2 and calls["reset"] == 1
    assert peer.generate([1], SamplingParams(max_new_tokens=2, ignore_eos=True)).token_ids == [5, 6]
    assert parse_compare("llamacpp,llamacpp:prompt-lookup", has_draft=False) == ["llamacpp", "llamacpp:prompt-lookup"]
