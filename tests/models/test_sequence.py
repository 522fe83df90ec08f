"""`TreeSequence`, the pending-tree handshake both backends' sequences share: the same guards,
messages and bookkeeping on the Hugging Face and the native backend."""

import pytest
import torch

from tiny import tiny_model
from specula.models.base import TargetSequence
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.models.sequence import TreeSequence
from specula.tree import TokenTree


def new_sequence(backend: str) -> TreeSequence:
    model = tiny_model("llama")
    if backend == "hf":
        return HFCausalLM(model).new_sequence()
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), "aten", "none", "sdpa"), "native").new_sequence()


BACKENDS = ["hf", "native"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pending_tree_must_be_committed_before_more_work(backend):
    seq = new_sequence(backend)
    assert isinstance(seq, TreeSequence) and isinstance(seq, TargetSequence)
    with pytest.raises(RuntimeError, match="commit\\(\\) without a pending forward_tree"):
        seq.commit([])
    seq.prefill([1, 2, 3], logits="none")
    seq.forward_tree(4, TokenTree.chain([5, 6]))
    for call in (lambda: seq.prefill([7]), lambda: seq.forward_tree(7, TokenTree.empty()), lambda: seq.crop(1)):
        with pytest.raises(RuntimeError, match="while a tree is pending: commit\\(\\) it first"):
            call()
    seq.commit([0])
    assert seq.tokens == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_incremental_growth_needs_a_pending_prefix_tree(backend):
    seq = new_sequence(backend)
    seq.prefill([1, 2, 3], logits="none")
    with pytest.raises(RuntimeError, match="needs a pending tree"):
        seq.forward_tree_incremental(TokenTree.chain([5]))
    seq.forward_tree(4, TokenTree.chain([5, 6]))
    with pytest.raises(ValueError, match="extend the pending tree"):
        seq.forward_tree_incremental(TokenTree.chain([5, 7, 8]))
    empty = seq.forward_tree_incremental(TokenTree.chain([5, 6]))  # nothing new: no rows, no pass
    assert empty.shape == (0, 96) and empty.dtype == torch.float32
    grown = seq.forward_tree_incremental(TokenTree.chain([5, 6, 7]))
    assert grown.shape == (1, 96)
    seq.commit([0, 1, 2])
    assert seq.tokens == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_crop_and_release_keep_the_books(backend):
    seq = new_sequence(backend)
    assert seq.prefill([]) is None
    logits, hidden = seq.prefill([], hidden=True)
    assert logits is None and hidden.shape == (0, 32)
    with pytest.raises(RuntimeError, match="300 tokens exceed the context window of 256"):
        seq.prefill(list(range(300)), logits="none")
    assert seq.tokens == []
    assert seq.prefill([1, 2, 3, 4]).shape == (96,)
    assert seq.prefill([5, 6], logits="all").shape == (2, 96)
    with pytest.raises(ValueError, match=r"crop\(7\) outside 0..6"):
        seq.crop(7)
    seq.crop(3)
    assert seq.tokens == [1, 2, 3]
    with pytest.raises(RuntimeError, match="context window"):
        seq.forward_tree(4, TokenTree.chain(list(range(253))))
    seq.release()
    assert seq.tokens == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_commit_of_nodes_that_are_not_a_root_path_is_refused_and_the_tree_kept(backend):
    seq = new_sequence(backend)
    seq.prefill([5, 6, 7], logits="none")
    seq.forward_tree(9, TokenTree.build([10, 11, 12], [-1, 0, -1]))  # 10 -> 11, and 12 beside 10
    for path in ([1], [0, 2], [2, 0], [5], [-1]):
        with pytest.raises(ValueError, match="not a path from the root"):
            seq.commit(path)
    seq.commit([0, 1])  # still pending: a valid path commits
    assert seq.tokens == [5, 6, 7, 9, 10, 11]
