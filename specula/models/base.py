"""The backend protocol: what the engine, drafters, planner, bench and server may ask of a model.

A `TargetModel` holds what requests share (weights, kernels); each request gets its own
`TargetSequence` (`new_sequence()`), the KV cache of one sequence. A sequence's cache holds
exactly its committed tokens, except between `forward_tree` and `commit`:

    seq.prefill(prompt[:-1])             cache = prompt without its last token (the first root)
    logits = seq.forward_tree(root, tree)    root + every tree node in one pass, tree attention
    seq.commit(path)                     cache = prefix + root + accepted path, nothing else

Row convention (shared with `specula.tree` and `specula.verify`): `forward_tree` returns
`[n + 1, vocab]` logits, row 0 after the root, row i + 1 after node i; a node sees the committed
prefix, the root and its own ancestors, at position `len(prefix) + depth`.

Draft models are backends too (a draft-model drafter keeps one `TargetSequence` per request).
Nothing outside `specula.models` touches a backend's underlying model object.
"""

from __future__ import annotations

import typing
from typing import Any, Iterable, Literal, Protocol, Sequence, Union, runtime_checkable

import torch

from specula.errors import ConfigError
from specula.tree import TokenTree

LogitsMode = Literal["last", "all", "none"]
"""What `prefill` returns: logits of the last token [vocab], of every token [n, vocab], or None."""

SubLayer = tuple[int, str]
"""A decoder sub-layer: (layer index, "attn" | "mlp")."""

GreedyGuarantee = Literal["bitwise", "float32", "near-ties"]
"""How exactly a backend's tree rows reproduce one-token steps:
"bitwise": every row is computed alone (row-invariant linears and attention): speculative greedy
output is plain greedy output token for token, by construction;
"float32": rows differ from one-token steps by float32 rounding (1e-6 relative), which has not
changed a greedy token in any measurement; a difference is reported as a bug;
"near-ties": bfloat16 / float16 rounding: where two tokens are within that precision the
argmax can flip, so outputs can differ from plain decoding at such ties (and the bench reports
the identical fraction instead of failing); float32 (`--dtype float32`) restores "float32"."""


@runtime_checkable
class TargetSequence(Protocol):
    """The KV cache of one sequence on a backend (one request's, or a drafter's)."""

    @property
    def tokens(self) -> list[int]:
        """The committed tokens the cache holds, in order (read-only)."""
        ...

    def prefill(self, ids: Sequence[int], logits: LogitsMode = "last", hidden: FeatureRequest = False) -> Any:
        """Run `ids` causally after the cache and commit them. With `hidden` (a `FeatureRequest`, on
        backends that are `FeatureModel`s): `(logits, hidden [len(ids), k E])` from the same pass
        (True: the last hidden state of every row, the final-normed features the output head reads)."""
        ...

    def forward_tree(self, root: int, tree: TokenTree, hidden: FeatureRequest = False) -> Any:
        """Logits [n + 1, vocab] of the root and every node (tree attention); the tree is then
        pending until `commit`. With `hidden`: `(logits, hidden [n + 1, k E])` from the same pass."""
        ...

    def forward_tree_incremental(self, tree: TokenTree) -> torch.Tensor:
        """Grow the pending tree (`tree` starts with its nodes): logits [new nodes, vocab]."""
        ...

    def commit(self, path: Sequence[int]) -> None:
        """Keep prefix + root + the accepted `path` (node indices, root to deepest)."""
        ...

    def crop(self, length: int) -> None:
        """Keep the first `length` committed tokens (rollback)."""
        ...

    def release(self) -> None:
        """Free the cache now (the sequence must not be used again)."""
        ...


@runtime_checkable
class PrefixCopyingSequence(Protocol):
    """A sequence that can start as a copy of another's committed prefix (the engine's prefix cache,
    `prefix_cache.PrefixCache`: a request whose prompt starts with tokens a finished request's cache holds
    reads their keys and values instead of prefilling them). A backend whose sequences are such says so
    with `copies_prefixes = True`."""

    @property
    def memory_bytes(self) -> int:
        """Bytes its cache occupies (its capacity, not only the committed slots)."""
        ...

    def shrink_to_fit(self) -> None:
        """Free what its cache holds past the committed tokens (a finished request's sequence, kept for its
        prefix: its capacity grew by doubling, so up to half of it was empty)."""
        ...

    def copy_prefix(self, source: "PrefixCopyingSequence", length: int) -> None:
        """Make this new, empty sequence hold `source`'s first `length` committed tokens (their keys and
        values copied; `source` is unchanged and may be pending)."""
        ...


@runtime_checkable
class TargetModel(Protocol):
    """A model that verifies token trees (see the module docstring)."""

    name: str
    """Short name for messages."""
    vocab_size: int
    """Width of the logits (the output layer may be padded past the tokenizer)."""
    max_context: int
    """Most tokens one sequence may hold (prompt + generated)."""
    eos_token_ids: frozenset[int]
    """Token ids that end generation."""
    device: torch.device
    """Where the weights and caches live."""
    dtype: torch.dtype
    """Floating dtype of the activations."""
    greedy_guarantee: "GreedyGuarantee"
    """What "speculative greedy output = plain greedy output" means on this backend (see
    `GreedyGuarantee`)."""
    num_parameters: int
    """Parameters of the model (its size, whatever the storage)."""

    @property
    def weight_bytes(self) -> int:
        """Bytes its weights occupy as loaded (packed kernels, quantization included)."""
        ...

    def new_sequence(self) -> TargetSequence:
        """An empty KV cache for one sequence."""
        ...

    def cost_key(self) -> dict[str, Any]:
        """What the latency of a forward pass depends on (model, backend, dtype, kernels,
        quantization, threads, device): the planner caches cost curves under it."""
        ...

    def padded_tokens(self, n: int) -> int:
        """Rows a pass of n tokens really costs (a captured graph's bucket on CUDA; else n): the
        planner prices a tree at its bucket."""
        ...

    def reference_model(self) -> Any:
        """A Hugging Face model with these weights (for the bench's `generate` peers and
        diagnostics), or None when the backend cannot give one."""
        ...


FeatureRequest = Union[bool, tuple[int, ...]]
"""What a pass returns next to its logits (`hidden=` on `prefill`, `forward_tree`, `forward_trees`):
False nothing; True the last hidden state of every row [n, E] (final-normed: what the output head
reads); a tuple of layer indices 0 .. num_layers the residual stream entering each of those
decoder layers (index num_layers = the final-normed state), concatenated in that order [n, k E]
(EAGLE-3's features: the inputs of layers 2, N / 2 and N - 3)."""


def feature_layers(hidden: FeatureRequest, num_layers: int) -> tuple[int, ...]:
    """The layer indices a (true) `FeatureRequest` asks for (True = (num_layers,)); the one place a
    request is checked: a ConfigError names a layer the model does not have."""
    layers = (num_layers,) if hidden is True else tuple(int(i) for i in hidden)
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if not layers or bad:
        raise ConfigError(f"hidden-state features of layers {list(layers)} asked of a {num_layers}-layer model: "
                          f"layer indices must be in 0..{num_layers} ({num_layers} = the final-normed state); "
                          "the head was trained for a model of another depth: use one trained for this target")
    return layers


@runtime_checkable
class FeatureModel(Protocol):
    """A backend whose passes can also return hidden states of each row (`hidden=` a
    `FeatureRequest` on `prefill`, `forward_tree`, `forward_trees`: the last one, or the inputs of
    chosen layers) and that shares its token embedding and output head, read-only: what trained
    drafters (EAGLE, EAGLE-3, Medusa, Hydra heads) need, without reaching into the model object."""

    hidden_size: int
    """E: width of the hidden states."""
    num_layers: int
    """N: decoder layers (a `FeatureRequest` names layers 0 .. N)."""

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings [n, E] of token ids [n] (long)."""
        ...

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [k, E] of the output head for token ids [k]: logits of those tokens = hidden @ rows.T."""
        ...


@runtime_checkable
class BatchedTargetModel(Protocol):
    """A backend that verifies the trees of several sequences in one forward pass (continuous
    batching): the rows of every sequence are packed, each attends only to its own cache through
    its own tree mask. Each returned block is what that sequence's `forward_tree` would return
    (bit for bit where the backend's rows are row invariant, `greedy_guarantee == "bitwise"`)."""

    def forward_trees(self, items: Sequence[tuple[TargetSequence, int, TokenTree]], hidden: FeatureRequest = False) -> list:
        """(sequence, root, tree) per sequence -> logits [n_i + 1, vocab] per sequence (with `hidden`:
        `(logits, hidden [n_i + 1, k E])` each); every tree is then pending on its sequence until
        `commit`."""
        ...


@runtime_checkable
class ArgmaxScreeningModel(Protocol):
    """A backend whose greedy passes can take their rows' argmax without the logits (`forward_trees`'
    `argmax_only`: the native backend's output screen, `models.native.screen`)."""

    @property
    def lazy_logits(self) -> bool:
        """Whether its passes take the argmax that way now (an output layer the screen pays on)."""
        ...

    @property
    def lazy_top_logits(self) -> bool:
        """Whether its screened passes also pay for a truncated sample's kept ids (top-k, min-p: hundreds of
        candidates a row where an argmax has one or two)."""
        ...

    @property
    def lazy_nucleus_logits(self) -> bool:
        """Whether its screened passes also pay for top-p over every id (bounds on every id left out: a large
        output layer)."""
        ...

    def output_screen(self) -> Any:
        """Build the screen now (else the first greedy pass does)."""
        ...

    def forward_trees(self, items: Sequence[tuple[TargetSequence, int, TokenTree]], hidden: FeatureRequest = False,
                      argmax_only: bool = False) -> list:
        """`BatchedTargetModel.forward_trees`; with `argmax_only`, a pass it screens returns row sources
        (`specula.verify.Rows`) whose `argmax(-1)` is exact and whose other uses compute the logits."""
        ...


_CONFORMING: dict[tuple[type, type], bool] = {}
"""(class, protocol) -> whether the class itself defines every member of the protocol (`conforms`)."""


def conforms(obj: object, protocol: type) -> bool:
    """`isinstance(obj, protocol)` for a runtime-checkable protocol, answered from a cache where the object's class
    defines every member itself (then every instance of it conforms). Python's check looks each member up on the
    object (0.01-0.02 ms, and more where it runs cold after a pass: about 0.07 ms of a SmolLM2 step went to the
    three checks of each step); an object whose class lacks a member is checked as before (an instance attribute
    may supply it)."""
    cls = type(obj)
    whole = _CONFORMING.get((cls, protocol))
    if whole is None:
        members = getattr(protocol, "__protocol_attrs__", None) or typing._get_protocol_attrs(protocol)
        whole = _CONFORMING[(cls, protocol)] = all(hasattr(cls, name) for name in members)
    return whole or isinstance(obj, protocol)


def screens_argmax(target: object, top: bool = False, nucleus: bool = False) -> bool:
    """Whether `target`'s greedy passes take their argmax through an output screen now (`top`: and a truncated
    sample's kept ids, `ArgmaxScreeningModel.lazy_top_logits`; `nucleus`: top-p over every id's,
    `lazy_nucleus_logits`)."""
    return (conforms(target, ArgmaxScreeningModel) and target.lazy_logits and (not top or target.lazy_top_logits)
            and (not nucleus or target.lazy_nucleus_logits))


def forward_trees(target: TargetModel, items: Sequence[tuple[TargetSequence, int, TokenTree]],
                  hidden: FeatureRequest = False, argmax_only: bool = False) -> list:
    """Verify several sequences' trees: one packed pass where the backend batches
    (`BatchedTargetModel`), else one `forward_tree` per sequence. With `hidden` (a `FeatureModel`
    backend), each item's result is `(logits, hidden states)`. `argmax_only`: the caller needs each
    row's greedy argmax (`argmax(-1)`); a backend that can take it more cheaply than the logits
    (`ArgmaxScreeningModel`) then returns a row source shaped like them (`specula.verify.Rows`) whose
    other uses still read the exact logits."""
    if hidden and not conforms(target, FeatureModel):
        raise ConfigError(f"{target.name} cannot return hidden states (trained drafters need them): "
                          "use the native or hf backend")
    if argmax_only and screens_argmax(target):
        return target.forward_trees(items, hidden=hidden, argmax_only=True)
    if len(items) > 1 and conforms(target, BatchedTargetModel):
        return target.forward_trees(items, hidden=hidden) if hidden else target.forward_trees(items)
    return [seq.forward_tree(root, tree, hidden=hidden) if hidden else seq.forward_tree(root, tree)
            for seq, root, tree in items]


@runtime_checkable
class LayerSkippingModel(Protocol):
    """A backend that can run its own model with decoder sub-layers skipped, as a draft of itself
    (SWIFT, `--draft skip`, the `layer-skip` method): its sequences are `LayerSkipSequence`s. The
    native backend implements it."""

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model (skip sets name layers 0 .. num_layers - 1)."""
        ...

    def layer_skip_cost(self, skip: Iterable[SubLayer]) -> float:
        """Fraction of a one-token pass's weights that a pass with sub-layers `skip` skipped reads:
        the draft's cost per token in target steps, before overheads."""
        ...


@runtime_checkable
class LayerSkipSequence(Protocol):
    """A target sequence that can also run its model with decoder sub-layers skipped, as a draft
    of itself (SWIFT), on the full model's cache of the committed prefix and without changing the
    sequence: rows go to scratch slots the next `forward_tree` overwrites. The sequences of a
    `LayerSkippingModel` implement it; drafters reach it through `DraftContext.target`."""

    @property
    def num_layers(self) -> int:
        """Decoder layers of the model."""
        ...

    def speculate(self, ids: Sequence[int], skip: Sequence[SubLayer] = (), offset: int = 0) -> torch.Tensor:
        """Logits [n, vocab] of `ids` after the committed tokens and `offset` earlier drafted rows."""
        ...

    def replay(self, count: int, skip: Sequence[SubLayer] = (), trace: dict[SubLayer, float] | None = None,
               end: int | None = None) -> torch.Tensor:
        """Logits [count, vocab] of the `count` committed tokens before `end` (default: the last
        ones) run again (teacher forcing); `trace` gets each sub-layer's turn of the stream."""
        ...


def guarantee_of(dtype: torch.dtype, batch_invariant: bool) -> GreedyGuarantee:
    """The `GreedyGuarantee` of a backend running `dtype` with or without row-invariant kernels."""
    if batch_invariant:
        return "bitwise"
    return "near-ties" if dtype in (torch.bfloat16, torch.float16) else "float32"


def check_context(model: TargetModel, n_tokens: int, what: str = "the prompt") -> None:
    """The one context-window check: `n_tokens` must fit `model.max_context` (ConfigError naming
    the fix otherwise). The engine calls it once per request, before prefill."""
    if n_tokens > model.max_context:
        raise ConfigError(
            f"{what} needs {n_tokens} tokens but {model.name}'s context window is {model.max_context}; "
            "shorten the prompt"
        )


def output_room(context_window: int, prompt_len: int, max_new_tokens: int | None = None) -> int:
    """How many new tokens fit after a prompt of `prompt_len` tokens in a context window of `context_window`
    (0 when the prompt fills it), at most `max_new_tokens` when given: the engine stops there ("length")."""
    room = max(0, context_window - prompt_len)
    return room if max_new_tokens is None else min(room, max_new_tokens)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def keep_common_prefix(seq: TargetSequence, tokens: Sequence[int], limit: int | None = None) -> int:
    """Roll `seq` back to its longest common prefix with `tokens` (at most `limit` tokens) and
    return that length: the cache then needs `tokens[length:]` to catch up. This is how a draft
    model's cache drops the previous step's rejected drafts."""
    keep = common_prefix_length(seq.tokens, tokens)
    if limit is not None:
        keep = min(keep, limit)
    seq.crop(keep)
    return keep
