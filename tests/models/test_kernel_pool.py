"""The kernels' thread pool (`kernels/pool.c`): which thread computes a column block never changes
a bit, calls from several Python threads at once stay correct, and a forked child computes with
its own workers."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

from specula.models.native import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")


def _layers():
    torch.manual_seed(0)
    lin = nn.Linear(300, 515)  # 33 column blocks, the last one partial
    return {kind: kernels.KernelLinear(lin, kind) for kind in kernels.KINDS}


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_every_thread_count_gives_the_same_bits(threads):
    layers, x = _layers(), torch.randn(9, 300)
    outs = {}
    for n in (1, 2, 3, 5):
        torch.set_num_threads(n)
        for kind, layer in layers.items():
            y = layer(x)
            assert torch.equal(y, outs.setdefault(kind, y)), (kind, n)
    assert kernels.library().specula_pool_workers() >= 1  # the multi-threaded calls used the pool


def test_concurrent_calls_from_python_threads_are_correct(threads):
    torch.set_num_threads(2)
    layers, x = _layers(), torch.randn(7, 300)
    expected = {kind: layer(x) for kind, layer in layers.items()}
    failures = []

    def work():
        for _ in range(40):
            for kind, layer in layers.items():
                if not torch.equal(layer(x), expected[kind]):
                    failures.append(kind)

    workers = [threading.Thread(target=work) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_computes_the_same(threads):
    torch.set_num_threads(2)
    layer, x = _layers()["f32"], torch.randn(5, 300)
    expected = layer(x)  # the parent's workers exist now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: its pool starts empty and must still compute (and finish)
        ok = torch.equal(layer(x), expected) and torch.equal(layer(x), expected)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"


@pytest.mark.parametrize("first, env, warned", [
    ("torch", {}, True),  # torch's OpenMP read its spin before specula could set it
    ("specula", {}, False),  # specula set GOMP_SPINCOUNT before torch loaded
    ("torch", {"GOMP_SPINCOUNT": "10000"}, False),  # the user chose
])
def test_the_backend_says_when_torch_came_first_and_kept_its_openmp_spin(first, env, warned):
    import subprocess
    import sys

    code = (f"import {first}\nimport specula\nfrom specula.models.native.kernels import openmp_spin_warning\n"
            "print(openmp_spin_warning(2))\nprint(openmp_spin_warning(1))")
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert (out[0] != "None") == warned
    if warned:
        assert "GOMP_SPINCOUNT=10000" in out[0] and "import specula before torch" in out[0]
    assert out[1] == "None"  # one thread: no pool helper to take a core from
