"""The native backend: `NativeDecoder` behind the `TargetModel` protocol.

Each `NativeSequence` owns a static KV cache (`cache.KVCache`). A tree pass writes the root and
every node at consecutive slots after the committed prefix and attends through a boolean mask
over slots (prefix + the row's own ancestors); `commit` moves the accepted path's rows next to
the root (a gather of the path only). The same decoder serves one-token decoding, prefills and
trees, so plain and speculative decoding run the same code.

On CUDA, passes of up to 64 rows run as captured CUDA graphs by default (`graphs.py`: row
buckets, a fixed attention window, the cache written inside the graph); `cuda_graphs=False`
(`--no-cuda-graphs`) keeps every pass eager. Longer prefills, packed multi-sequence passes,
passes with sub-layers skipped or traced, and decoders the graph path cannot run
(`graphs.graph_unsupported`) stay eager.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from specula.errors import ConfigError
from specula.models.base import FeatureRequest, LogitsMode, SubLayer, feature_layers, guarantee_of
from specula.models.cost_key import cost_key_of
from specula.models.linears import quantization_of
from specula.models.native.cache import KVCache
from specula.models.native.graphs import GraphRunner, graph_unsupported
from specula.models.native.model import NativeDecoder, Segment
from specula.models.native.screen import OutputScreen, ScreenedPass
from specula.models.sequence import TreeSequence
from specula.tree import TokenTree

GRAPHS_OFF = "turn them off (cuda_graphs=False)"
"""The advice when the graph path was asked for and cannot run: `NativeCausalLM`'s keyword (the command line asks
through `device.set_cuda_graphs`, `--cuda-graphs`, and shows `--no-cuda-graphs`: `commands.common.command_flags`)."""

PREFILL_ACTIVATION_BYTES = 20 << 20
"""On a CPU whose rows are computed alone (greedy guarantee "bitwise"), a prompt runs in passes of as many tokens as
keep one pass's MLP activations (gate and up, float32: 8 x intermediate_size bytes a token) within this many bytes;
bit for bit the same keys, values, logits and hidden states as one pass, and faster where one pass's activations would
outgrow the caches. On 2 Zen 4 cores (32 MB of L3), `scripts/prefill_chunks.py`, best of 2-3: Qwen2.5-Coder-1.5B
(292 tokens a pass) ran 1,600 tokens in 11.1 s against 13.3 s in one pass, and 800 in 5.4 s against 5.9 s; SmolLM2-135M
(1,706 a pass) keeps such prompts in one pass, which was 3-7% faster for it than passes of 256."""


def prefill_pass_of(intermediate_size: int) -> int:
    """The most tokens one prefill pass runs on an exact CPU (`PREFILL_ACTIVATION_BYTES`), at least 64."""
    return max(64, PREFILL_ACTIVATION_BYTES // (8 * intermediate_size))


class NativeCausalLM:
    """A Llama / Qwen2 / Mistral model on specula's own decoder (a `TargetModel`, a `FeatureModel` and
    a `LayerSkippingModel`)."""

    def __init__(self, decoder: NativeDecoder, name: str = "model", *, eos_token_ids: Sequence[int] = (),
                 reference: Callable[[], Any] | None = None, model_id: str = "",
                 cuda_graphs: bool | None = None) -> None:
        self.decoder = decoder
        self.name = name
        self._screen = None  # native.screen.OutputScreen: `output_screen`
        cfg = decoder.cfg
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.max_context = cfg.max_position
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        param = decoder.final_norm
        self.device, self.dtype = param.device, param.dtype
        from specula.models.native.ops import CpuKernelOps

        invariant = isinstance(decoder.ops, CpuKernelOps) or (decoder.invariant and quantization_of(decoder) == "int8")
        if isinstance(decoder.ops, CpuKernelOps):
            from specula.models.native.kernels import openmp_spin_warning

            spin = openmp_spin_warning()
            if spin is not None:
                warnings.warn(spin, RuntimeWarning, stacklevel=2)
        self.greedy_guarantee = guarantee_of(self.dtype, invariant)
        exact_cpu = self.device.type == "cpu" and self.greedy_guarantee == "bitwise"
        self.prefill_pass: int | None = prefill_pass_of(cfg.intermediate_size) if exact_cpu else None
        """The most tokens one prefill pass runs (`prefill_pass_of`; None: a prompt in one pass)."""
        self.num_parameters = decoder.num_parameters
        self._reference = reference
        self._reference_model = None
        self._model_id = model_id
        self.graphs: GraphRunner | None = None
        """The CUDA-graph path (`graphs.GraphRunner`), or None: every pass eager."""
        self.set_cuda_graphs(cuda_graphs)

    # ------------------------------------------------------------------ CUDA graphs
    def set_cuda_graphs(self, enabled: bool | None = None, *, capture: bool | None = None,
                        compile_ops: bool | None = None, attention: str = "matmul") -> None:
        """Turn the graph path on or off for sequences created from now on. None = the default: on
        for a CUDA device unless turned off (`--no-cuda-graphs`, `SPECULA_CUDA_GRAPHS=0`:
        `device.cuda_graphs_wanted`) or the decoder cannot run it (`graphs.graph_unsupported`; then
        asking for it explicitly, `enabled=True`, `--cuda-graphs` or `SPECULA_CUDA_GRAPHS=1`
        (`device.cuda_graphs_asker`), is a `ConfigError` naming the ask). `capture=False` runs the same
        fixed-shape passes without capturing them (any device: tests); `compile_ops` fuses their element-wise ops
        with torch.compile (None: `SPECULA_CUDA_GRAPHS=compile` says);
        `attention`: "matmul" (default) or "sdpa" inside the passes (`graphs.attend_matmul`)."""
        from specula.models.device import cuda_graphs_compile, cuda_graphs_wanted

        asker = "" if enabled is not None else None  # "": asked for here (enabled=True), by its keyword
        if enabled is None:  # the default, unless --cuda-graphs or SPECULA_CUDA_GRAPHS=1 asked for it on CUDA
            enabled = self.device.type == "cuda" and cuda_graphs_wanted()
            asker = self._graphs_asker() if enabled else None
        if not enabled:
            self.graphs = None
            return
        why = graph_unsupported(self.decoder)
        if why is not None:
            if asker is not None:
                raise self._graphs_refused(why, asker)
            self.graphs = None
            return
        capture = True if capture is None else capture
        compile_ops = cuda_graphs_compile() if compile_ops is None else compile_ops
        if capture and self.device.type != "cuda":
            raise ConfigError(f"{self.name}: CUDA graphs need a CUDA device, not {self.device}; {GRAPHS_OFF}")
        self.graphs = GraphRunner(self.decoder, capture=capture, compile_ops=compile_ops, attention=attention)

    @staticmethod
    def _graphs_asker() -> str | None:
        """Who asked for the graph path process-wide (`device.cuda_graphs_asker`): "" for `set_cuda_graphs(True)`
        (`--cuda-graphs`: the advice is `GRAPHS_OFF`), the variable for `SPECULA_CUDA_GRAPHS=1`, None for nobody."""
        from specula.models.device import GRAPHS_ASKED, cuda_graphs_asker

        asker = cuda_graphs_asker()
        return "" if asker == GRAPHS_ASKED else asker

    def _graphs_refused(self, why: str, asker: str) -> ConfigError:
        """The refusal of the graph path asked for (`asker`: "" by a keyword or `--cuda-graphs`, else the environment
        variable that asked) on a decoder it cannot run (`why`)."""
        from specula.models.device import cuda_graphs_unasked

        by, fix = (f" (asked for by {asker})", cuda_graphs_unasked(asker)) if asker else ("", GRAPHS_OFF)
        return ConfigError(f"{self.name}: CUDA graphs cannot run this decoder{by}: {why}; {fix}")

    @property
    def cuda_graphs(self) -> bool:
        """Whether passes are captured and replayed (not merely run at the graph path's shapes)."""
        return self.graphs is not None and self.graphs.capture

    def padded_tokens(self, n: int) -> int:
        """Rows a pass of n tokens really costs: its bucket on the graph path (1, 2, 4, ..., 64), else
        n (the planner's cost model rounds tree sizes with it)."""
        return n if self.graphs is None else self.graphs.padded(n)

    # ------------------------------------------------------------------ LayerSkippingModel
    @property
    def num_layers(self) -> int:
        """Decoder layers of the model."""
        return self.config.num_layers

    def layer_skip_cost(self, skip: Iterable[SubLayer]) -> float:
        """Fraction of a one-token pass's weights that a pass with sub-layers `skip` skipped reads
        (the embedding lookup aside): the draft's cost per token in target steps, before overheads."""
        cfg = self.config
        e, d = cfg.hidden_size, cfg.head_dim
        attn = e * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * e
        mlp = 3 * e * cfg.intermediate_size
        head = e * cfg.vocab_size
        total = cfg.num_layers * (attn + mlp) + head
        skipped = sum(attn if kind == "attn" else mlp for _, kind in set(skip))
        return (total - skipped) / total

    @property
    def weight_bytes(self) -> int:
        from specula.models.linears import weight_bytes

        return weight_bytes(self.decoder)

    # ------------------------------------------------------------------ TargetModel
    copies_prefixes = True
    """Its sequences start as copies of others' committed prefixes (`NativeSequence.copy_prefix`): the
    engine's prefix cache."""

    def new_sequence(self) -> "NativeSequence":
        return NativeSequence(self)

    def cost_key(self) -> dict[str, Any]:
        cfg = self.config
        return cost_key_of(self.decoder, model=self._model_id or self.name, arch=cfg.architecture,
                           layers=cfg.num_layers, hidden=cfg.hidden_size, backend="native", dtype=self.dtype,
                           shape=(cfg.vocab_size, cfg.intermediate_size, cfg.num_kv_heads),
                           device=self.device, attention="batch_invariant" if self.decoder.invariant else "sdpa",
                           cuda_graphs=self.cuda_graphs)

    def reference_model(self) -> Any:
        """The Hugging Face model of the same weights (loaded on first use, for peers)."""
        if self._reference_model is None and self._reference is not None:
            self._reference_model = self._reference()
        return self._reference_model

    # ------------------------------------------------------------------ one pass
    # ------------------------------------------------------------------ FeatureModel
    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[n] long -> [n, E] input embeddings."""
        with torch.inference_mode():
            return self.decoder.embed(ids.to(self.device))

    def input_embeddings(self) -> torch.Tensor:
        """The input embedding table [V, E], read-only (a drafting head's kernel pass looks its rows
        up in C: `heads.kernel_pass.embedding_table`)."""
        return self.decoder.embed.weight.detach()

    def output_layer(self) -> torch.nn.Module:
        """The output head ([.., E] -> [.., V] logits)."""
        return self.decoder.lm_head

    @property
    def tied_output(self) -> bool:
        """Whether the output head's rows are the input embedding's (`output_rows` reads those)."""
        return bool(self.config.tie_embeddings)

    def set_output_layer(self, layer: torch.nn.Module) -> None:
        """Replace the output head (`models.draft_vocab`: a draft's head over its draft vocabulary)."""
        self.decoder.lm_head = layer

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[k] long -> [k, E] rows of the output head: the embedding when tied, else the head's own
        rows (a kernel's, `KernelLinear.weight_rows`, or a plain weight's); a head of another kind is
        read back through itself (head(I) = W^T: a pass over every row)."""
        from specula.models.linears import head_rows

        ids = ids.to(self.device)
        with torch.inference_mode():
            if self.config.tie_embeddings:
                return self.decoder.embed.weight[ids]
            return head_rows(self.decoder.lm_head, ids, self.dtype, self.device).to(self.dtype)  # [k, E]

    def run(self, seq: "NativeSequence", ids: Sequence[int], positions: torch.Tensor, mask: torch.Tensor | None,
            logit_rows: slice | None, prefill: bool = False, *, start: int | None = None,
            skip: frozenset = frozenset(), trace: dict | None = None, hidden: FeatureRequest = False,
            prefix: int | None = None) -> Any:
        """Run rows `ids` of one sequence at `positions` ([n] long) from slot `start` (default
        seq.slots) with an attention `mask` ([n, start + n] bool, None for one row), sub-layers
        `skip` skipped; logits [rows, V] or None (with `hidden`, a `FeatureRequest`: (logits,
        features [n, k E])). `prefix` (default: the committed tokens): slots every row sees
        (mask[:, :prefix] is all True), which the graph path needs to know. Features of inner
        layers run eagerly (the graph path returns the final states only)."""
        n = len(ids)
        start = seq.slots if start is None else start
        taps = self._taps(hidden)
        states = features = None
        if self.graphs is not None and not skip and trace is None and not taps:
            if mask is None:  # one row that sees every slot up to its own
                prefix, local = start, np.ones((1, 1), dtype=bool)
            else:
                prefix = len(seq.tokens) if prefix is None else prefix
                local = mask[:, prefix:]
            states = self._graph_pass(seq, ids, positions, start, prefix, local)
        if states is None:
            seq.cache.reserve(start + n, start)
            tokens = torch.tensor(list(ids), dtype=torch.long, device=self.device)  # [n]
            mask = None if mask is None else mask.to(self.device)
            out = self.decoder(tokens, positions.to(self.device),
                               [Segment(seq.cache, start, slice(0, n), mask, prefill)], skip=skip, trace=trace,
                               taps=taps)
            states, features = out if taps else (out, None)  # [n, E], [n, k E]
        logits = None if logit_rows is None else self.decoder.logits(states[logit_rows])
        return (logits, states if features is None else features) if hidden else logits

    def _taps(self, hidden: FeatureRequest) -> tuple[int, ...]:
        """The layers a pass must tap for `hidden`: () when only the final states are wanted (the
        pass returns them anyway)."""
        if not hidden:
            return ()
        layers = feature_layers(hidden, self.config.num_layers)
        return () if layers == (self.config.num_layers,) else layers

    def _graph_pass(self, seq: "NativeSequence", ids: Sequence[int], positions: Any, start: int, prefix: int,
                    local: Any) -> torch.Tensor | None:
        """Hidden states [n, E] of the pass on the graph path, or None when it must run eagerly
        (a shape beyond the buckets, or a cache from before the graph path was turned on)."""
        graphs = self.graphs
        if seq.cache.owner is not graphs:
            return None
        shape = graphs.plan(len(ids), start, prefix, self.max_context)
        if shape is None:
            return None
        return graphs.run(seq.cache, shape, ids, positions, start, prefix, local)

    @property
    def lazy_logits(self) -> bool:
        """Whether `forward_trees(..., argmax_only=True)` can take its rows' argmax through an output
        screen (`native.screen`): a float32 output layer of specula's kernels, big enough to pay."""
        return self.graphs is None and OutputScreen.fits(self.decoder.lm_head)

    @property
    def lazy_top_logits(self) -> bool:
        """Whether a screened pass also pays for a truncated sample's kept ids (`screen.OutputScreen.edited_top`):
        `lazy_logits`, and through a w8 copy (AVX2 alone) an output layer of at least `screen.TOP_SCREEN_MIN_WEIGHTS`
        weights."""
        return self.graphs is None and OutputScreen.fits(self.decoder.lm_head, top=True)

    @property
    def lazy_nucleus_logits(self) -> bool:
        """Whether a screened pass also pays for top-p over every id (`edited_top`'s bounds on every other id):
        `lazy_logits` on an output layer of at least `screen.TOP_SCREEN_MIN_WEIGHTS` weights."""
        return self.graphs is None and OutputScreen.fits(self.decoder.lm_head, top=True, nucleus=True)

    def output_screen(self) -> Any:
        """The output layer's screen (`native.screen.OutputScreen`), built on first use (again after
        `set_output_layer`)."""
        if self._screen is None or self._screen.head is not self.decoder.lm_head:
            self._screen = OutputScreen(self.decoder.lm_head)
        return self._screen

    def forward_trees(self, items: Sequence[tuple["NativeSequence", int, TokenTree]],
                      hidden: FeatureRequest = False, argmax_only: bool = False) -> list:
        """Several sequences' trees in one pass (`BatchedTargetModel`): each sequence's handshake
        (`TreeSequence.begin_tree` before, `set_pending` after) around `tree_pass`. `argmax_only`:
        the caller needs each row's argmax (`argmax(-1)` of what it gets) and little else, so a pass
        of at most the screen's `max_rows` rows may return `ScreenedLogits` (where `lazy_logits`)."""
        for seq, _, _ in items:
            if not isinstance(seq, NativeSequence) or seq.backend is not self:
                raise ValueError("forward_trees: every sequence must belong to this backend")
        for seq, _, tree in items:
            seq.begin_tree(tree)
        out = self.tree_pass(items, hidden, argmax_only=argmax_only)
        for seq, root, tree in items:
            seq.set_pending(root, tree)
        return out

    def tree_pass(self, items: Sequence[tuple["NativeSequence", int, TokenTree]], hidden: FeatureRequest = False,
                  argmax_only: bool = False) -> list:
        """The pass of `forward_trees` (handshake done by the caller): rows packed sequence after
        sequence, one `Segment` each (its own cache, start slot and tree mask); logits split back
        (with `hidden`: (logits, features) per sequence). One sequence runs on the graph path
        where it is on (final states only); packed passes of several run eagerly."""
        taps = self._taps(hidden)
        if len(items) == 1 and self.graphs is not None and not taps:
            out = self._graph_tree(*items[0], hidden=hidden)
            if out is not None:
                return [out]
        tokens: list[int] = []
        positions: list[int] = []  # Python ints made a tensor once: three torch ops a sequence took 0.12 ms of
        segments, bounds = [], []  # a SmolLM2 step (each runs cold after the pass before)
        for seq, root, tree in items:
            start, first = len(seq.tokens), len(tokens)
            tokens.extend([root, *tree.tokens])
            positions.append(start)
            positions.extend([start + depth for depth in tree.depth])
            mask = tree_mask(start, tree).to(self.device) if len(tree) else None
            seq.cache.reserve(start + len(tree) + 1, start)
            segments.append(Segment(seq.cache, start, slice(first, len(tokens)), mask))
            bounds.append((first, len(tokens)))
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        out = self.decoder(ids, torch.tensor(positions, dtype=torch.long, device=self.device), segments, taps=taps)
        states, features = out if taps else (out, out)  # [T, E], [T, k E]
        if argmax_only and self.lazy_logits and len(tokens) <= self.output_screen().max_rows:
            screened = ScreenedPass(states, self.output_screen())
            per_item = [screened.rows(a, b) for a, b in bounds]
        else:
            logits = self.decoder.logits(states)  # [T, V]
            per_item = [logits[a:b] for a, b in bounds]
        if hidden:
            return [(rows, features[a:b]) for rows, (a, b) in zip(per_item, bounds)]
        return per_item

    def _graph_tree(self, seq: "NativeSequence", root: int, tree: TokenTree, hidden: FeatureRequest) -> Any:
        """One sequence's tree on the graph path (the mask's local block built directly), or None."""
        start = len(seq.tokens)
        n = len(tree) + 1
        local = np.zeros((n, n), dtype=bool)  # slot start + j, j = 0 the root
        local[:, 0] = True
        if n > 1:
            local[1:, 1:] = tree.ancestor_mask.numpy()
        positions = [start, *(start + d for d in tree.depth)]
        states = self._graph_pass(seq, [root, *tree.tokens], positions, start, start, local)
        if states is None:
            return None
        logits = self.decoder.logits(states)  # [n, V]
        return (logits, states) if hidden else logits


def causal_mask(start: int, n: int) -> torch.Tensor:
    """Bool [n, start + n]: row i sees slots 0 .. start + i."""
    return torch.ones((n, start + n), dtype=torch.bool).tril(start)


def tree_mask(start: int, tree: TokenTree) -> torch.Tensor:
    """Bool [n + 1, start + n + 1]: every row sees the prefix and the root; node rows their ancestors."""
    n = len(tree)
    mask = np.zeros((n + 1, start + n + 1), dtype=np.bool_)  # in numpy: torch's three ops took 3x as long
    mask[:, : start + 1] = True
    mask[1:, start + 1 :] = tree.ancestor_mask.numpy()
    return torch.from_numpy(mask)


class NativeSequence(TreeSequence):
    """One sequence's static KV cache on a `NativeCausalLM` (see the module docstring); the
    pending-tree handshake is `TreeSequence`'s, this class runs the passes and moves the rows."""

    backend: NativeCausalLM
    logits_dtype = torch.float32  # NativeDecoder.logits

    def __init__(self, backend: NativeCausalLM) -> None:
        super().__init__(backend)
        cfg = backend.config
        self._give_back = None
        if backend.graphs is not None:  # a pooled cache, its graphs with it; back to the pool when released
            self.cache = backend.graphs.take_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, backend.max_context)
            self._give_back = weakref.finalize(self, backend.graphs.give_back, self.cache)
        else:
            self.cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=backend.dtype,
                                 device=backend.device, max_capacity=backend.max_context)

    @property
    def slots(self) -> int:
        """Slots in use: the committed tokens (+ the pending tree's rows while one is pending)."""
        return len(self._tokens) + (len(self._pending[1]) + 1 if self._pending is not None else 0)

    @property
    def memory_bytes(self) -> int:
        """Bytes of its keys and values (the whole capacity)."""
        return 2 * self.cache.k.numel() * self.cache.k.element_size()

    def shrink_to_fit(self) -> None:
        """Free the cache's slots past those in use (`models.base.PrefixCopyingSequence`; a tree pending keeps its
        rows: a request that failed part-way through a step is kept as it stands)."""
        self.cache.shrink_to_fit(self.slots)

    def copy_prefix(self, source: "NativeSequence", length: int) -> None:
        """Hold `source`'s first `length` committed tokens (`models.base.PrefixCopyingSequence`): their slots
        copied, bit for bit what a prefill of them writes where the rows are row invariant."""
        if self._tokens or self._pending is not None:
            raise RuntimeError("copy_prefix() into a sequence that holds tokens: start from a new one")
        if not 0 <= length <= len(source.tokens):
            raise ValueError(f"copy_prefix of {length} tokens outside 0..{len(source.tokens)}")
        self.cache.copy_from(source.cache, length)
        self._tokens = list(source.tokens[:length])
        self._show_output(self._tokens)

    def _prefill_rows(self, ids: list[int], logits: LogitsMode, hidden: FeatureRequest) -> Any:
        step = self.backend.prefill_pass or len(ids)
        parts = [self._prefill_pass(ids[a: a + step], len(self._tokens) + a,
                                    logits if logits == "all" or a + step >= len(ids) else "none", hidden)
                 for a in range(0, len(ids), step)]  # each: (logits or None, states)
        if logits == "all":  # [len(ids), V]
            out = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
        else:
            out = parts[-1][0] if logits == "none" else parts[-1][0][0]  # None or [V]
        if not hidden:
            return out
        return out, parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])

    def _prefill_pass(self, ids: list[int], start: int, logits: LogitsMode, hidden: FeatureRequest) -> tuple:
        """One causal pass of `ids` from slot `start`: (logits of the rows `logits` asks for or None, the hidden
        states [len(ids), k E] where `hidden` asks, else None)."""
        n = len(ids)
        positions = torch.arange(start, start + n)
        mask = None if n == 1 else causal_mask(start, n)
        rows = {"last": slice(n - 1, n), "all": slice(0, n), "none": None}[logits]
        out = self.backend.run(self, ids, positions, mask, rows, prefill=True, start=start, hidden=hidden)
        return out if hidden else (out, None)

    def _tree_rows(self, root: int, tree: TokenTree, hidden: FeatureRequest) -> Any:
        return self.backend.tree_pass([(self, root, tree)], hidden=hidden)[0]

    def _grow_rows(self, root: int, tree: TokenTree, first: int) -> torch.Tensor:
        start = len(self._tokens)
        positions = tree.position_offsets[first:] + start
        mask = tree_mask(start, tree)[first + 1 :]  # rows of the new nodes
        return self.backend.run(self, tree.tokens[first:], positions, mask, slice(0, len(tree) - first))

    def _keep_rows(self, prefix: int, tree: TokenTree, path: list[int]) -> None:
        self.cache.keep(prefix, [0, *(i + 1 for i in path)])

    def _drop_rows(self, length: int) -> None:
        pass  # the slots beyond are overwritten by the next pass

    def _free(self) -> None:
        if self._give_back is not None:
            self._give_back()  # once: the cache (and its graphs) returns to the backend's pool
        self.cache = KVCache(*self.cache.shape, dtype=self.cache.dtype, device=self.cache.device, capacity=0)

    # ------------------------------------------------------------------ self-drafting (LayerSkipSequence)
    @property
    def num_layers(self) -> int:
        return self.backend.config.num_layers

    def speculate(self, ids: Sequence[int], skip: Iterable[SubLayer] = (), offset: int = 0) -> torch.Tensor:
        """Logits [n, vocab] of `ids` continuing the committed tokens and the `offset` rows earlier
        calls drafted, with sub-layers `skip` skipped. Rows go to scratch slots after the committed
        prefix (only in the layers that run; the next `forward_tree` overwrites them); the committed
        tokens and their cache are untouched."""
        if self._pending is not None:
            raise RuntimeError("speculate() while a tree is pending: commit() it first")
        ids = list(ids)
        if not ids:
            raise ValueError("speculate() needs at least one token")
        self._assert_room(offset + len(ids) + 1)
        start, n = len(self._tokens) + offset, len(ids)
        mask = None if n == 1 else causal_mask(start, n)
        return self.backend.run(self, ids, torch.arange(start, start + n), mask, slice(0, n), start=start,
                                skip=frozenset(skip))

    def replay(self, count: int, skip: Iterable[SubLayer] = (), trace: dict[SubLayer, float] | None = None,
               end: int | None = None) -> torch.Tensor:
        """Logits [count, vocab] of the `count` committed tokens before position `end` (default: the
        last ones) run again with sub-layers `skip` skipped, each seeing the full model's cache
        before them and the replayed rows before it (teacher forcing: row i predicts the token after
        it). Scratch slots only, like `speculate`. `trace` receives each run sub-layer's turn of the
        residual stream (`NativeDecoder.forward`)."""
        if self._pending is not None:
            raise RuntimeError("replay() while a tree is pending: commit() it first")
        length = len(self._tokens)
        end = length if end is None else end
        if not 1 <= count <= end <= length:
            raise ValueError(f"replay({count}, end={end}) outside the {length} committed tokens")
        self._assert_room(count)  # scratch slots length .. length + count - 1
        first = end - count
        mask = torch.zeros((count, length + count), dtype=torch.bool)
        mask[:, :first] = True
        mask[:, length:] = torch.ones((count, count), dtype=torch.bool).tril()
        return self.backend.run(self, self._tokens[first:end], torch.arange(first, end), mask, slice(0, count),
                                start=length, skip=frozenset(skip), trace=trace, prefix=first)

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, G, len, D], keys in Hugging Face's rotate-half layout
        (tests and tools; the cache itself holds them in pair layout, `model.rope_pairs_permutation`)."""
        from specula.models.native.model import rope_pairs_permutation

        back = torch.argsort(rope_pairs_permutation(self.backend.config.head_dim)).to(self.backend.device)
        return [(k[..., back], v) for k, v in self.cache.tensors(len(self._tokens))]
