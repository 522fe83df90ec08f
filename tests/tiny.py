"""Tiny random models (no downloads) and references shared by the tests."""

from __future__ import annotations

import copy
import random
from typing import Iterator, Sequence

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specula.tree import TokenTree

# Tiny models run far faster on one thread (and do not fight other processes for cores).
torch.set_num_threads(1)

VOCAB = 96
ARCHES = ("llama", "qwen2", "gpt2")


def word_tokenizer(words: Sequence[str] | int, *, decoder: bool = False, chat_template: str | None = None,
                   name: str | None = None, **special: str):
    """A word-level fast tokenizer, built offline (the one builder the tests share): ids follow
    `words` (a list, or n for w0 .. w{n-1}), a word not in it maps to the first, whitespace splits.
    `decoder`: decode through a WordPiece decoder (words joined by spaces); `special`: special
    tokens as `PreTrainedTokenizerFast` takes them (`eos_token="w1"`, ...). A declared special
    token becomes an added token, which matches inside words ("w10" -> "w1" "0"): declare none
    where such words occur, or name the words so that none is a prefix of another (w00 .. w95)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(words)] if isinstance(words, int) else list(words)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if decoder:
        backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if name is not None:
        tokenizer.name_or_path = name
    return tokenizer


def byte_fallback_tokenizer(byte_pieces: dict[int, str], vocab: int = VOCAB):
    """Llama-2 / Mistral style: "▁w<i>" words for ids 3.. (0 <unk>, 1 </s>, 2 <s>), byte tokens ("<0xE6>") or other
    pieces at the ids given, a ByteFallback decoder (a byte group that is not valid UTF-8 decodes to one U+FFFD a
    byte, rewriting a character already decoded) and a leading-space strip."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"▁w{i}" for i in range(vocab)]
    words[0], words[1], words[2] = "<unk>", "</s>", "<s>"
    for i, piece in byte_pieces.items():
        words[i] = piece
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def byte_pieces_tokenizer(vocab: int = VOCAB):
    """`byte_fallback_tokenizer` with all 256 byte pieces (ids 3..258, then "▁w<i>" words): byte groups that turn
    invalid rewrite characters already decoded."""
    return byte_fallback_tokenizer({3 + b: f"<0x{b:02X}>" for b in range(256)}, vocab)


def random_stop(rng: random.Random, tokenizer, vocab: int) -> str:
    """A stop string: 1-4 characters of the text of 1-3 random tokens, so it may start or end inside a token's
    text, span two tokens' texts, or never show."""
    text = ""
    while not text:  # (special tokens decode to nothing)
        text = tokenizer.decode([rng.randrange(2, vocab) for _ in range(rng.randrange(1, 4))])
    start = rng.randrange(len(text))
    return text[start: rng.randrange(start + 1, min(len(text), start + 4) + 1)]


def tiny_model(arch: str = "qwen2", attn: str = "sdpa", seed: int = 0, vocab: int = VOCAB, layers: int = 2):
    """A random causal LM small enough for exhaustive tests. Large init spreads the logits
    so that argmax ties (which float noise could flip) do not occur."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, attn_implementation=attn, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if arch == "qwen2":
        cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, **common)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, **common)
        model = LlamaForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=256, initializer_range=0.3, **common)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


def perturbed_copy(model, scale: float = 0.05, seed: int = 1):
    """A draft that mostly agrees with `model`: its weights plus small noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3))
    return draft.eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Plain greedy decoding by full recomputation (independent of specula's backend)."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        if eos is not None and tok == eos:
            break
    return out


def successor_model(vocab: int = VOCAB, arch: str = "llama"):
    """A model whose greedy next token is (last token + 1) mod vocab: attention and MLP
    outputs are zeroed, so logits depend on the last token's embedding only, and the
    output head holds each token's predecessor's embedding. Lets tests know exactly
    what a drafter should copy."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.randn(vocab, 128)
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(torch.roll(emb, 1, dims=0))
    return model


SPECULATIVE_PROMPTS = ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63, 64, 60, 61])
"""Prompts with repeats (prompt lookup finds matches) and without."""


def assert_speculative_greedy_equals_plain(model, method: str, reference, draft=None, max_new_tokens: int = 32) -> None:
    """Speculative greedy decoding of `model` with `method` (a draft model: `draft`, 5 tokens a step)
    outputs what plain greedy decoding of `reference` outputs, on each of SPECULATIVE_PROMPTS; with a
    draft model, drafts were really accepted (several tokens verified at a time)."""
    from specula.drafters import make_drafter
    from specula.engine import SpeculativeDecoder
    from specula.models.hf import HFCausalLM
    from specula.sampling import SamplingParams

    drafter = make_drafter(method, draft=HFCausalLM(draft) if draft is not None else None,
                           num_draft_tokens=5 if draft is not None else None)
    dec = SpeculativeDecoder(HFCausalLM(model, "target"), drafter, eos_token_ids=[])
    for prompt in SPECULATIVE_PROMPTS:
        out = dec.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
        assert out.token_ids == reference_greedy(reference, prompt, max_new_tokens), (method, prompt)
        if draft is not None:
            assert out.stats.accepted_tokens > 0


# ---------------------------------------------------------------------------- tree forwards
def random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    """A random tree of n nodes (duplicate siblings merged, so possibly fewer)."""
    parents = [-1] if n else []
    for i in range(1, n):
        parents.append(rng.randrange(-1, i))
    return TokenTree.empty().merge(TokenTree.build([rng.randrange(vocab) for _ in range(n)], parents))


@torch.inference_mode()
def causal_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1]


def assert_tree_logits_are_causal(model, prompt: list[int], tree: TokenTree, logits: torch.Tensor,
                                  *, same_argmax: bool = False) -> None:
    """logits [n+1, vocab]: row 0 equals the causal logits after the prompt, row i+1 those after
    the prompt plus node i's root-to-node path (and, with same_argmax, has the same argmax)."""
    assert logits.shape == (len(tree) + 1, model.config.vocab_size)
    for row, path in enumerate([()] + [tree.path_to(i) for i in range(len(tree))]):
        causal = causal_logits(model, prompt + tree.tokens_of(path))
        torch.testing.assert_close(logits[row], causal, atol=1e-4, rtol=1e-4)
        if same_argmax:  # what greedy verification reads
            assert logits[row].argmax() == causal.argmax(), row


def check_random_tree(model, seq, seed: int, prompt_len: int, nodes: int, *, cuts: tuple[int, ...] = (),
                      same_argmax: bool = False) -> TokenTree:
    """The tree-forward law on one random case: prefill a random prompt of `prompt_len` tokens but
    its last (the root) into the target sequence `seq`, run a random tree of `nodes` nodes (with
    `cuts`: `forward_tree` of its first cuts[0] nodes, then `forward_tree_incremental` to each
    further cut and to the whole tree) and assert every row equals `model`'s causal logits over
    that row's path (`assert_tree_logits_are_causal`). Returns the tree (left pending on `seq`)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
    seq.prefill(prompt[:-1], logits="none")
    tree = random_tree(rng, nodes, VOCAB)
    if not cuts:
        logits = seq.forward_tree(prompt[-1], tree)
    else:
        rows = [seq.forward_tree(prompt[-1], tree.subtree(range(cuts[0])))]
        rows += [seq.forward_tree_incremental(tree.subtree(range(end))) for end in (*cuts[1:], len(tree))]
        logits = torch.cat(rows)
    assert_tree_logits_are_causal(model, prompt, tree, logits, same_argmax=same_argmax)
    return tree


def assert_cache_equals_plain_forward(model, seq, committed: list[int]) -> None:
    """The sequence holds exactly `committed`, and its KV cache equals a plain causal forward's."""
    assert seq.tokens == committed
    with torch.inference_mode():
        ref = model(torch.tensor([committed]), use_cache=True).past_key_values
    for (k, v), layer in zip(seq.cache_tensors(), ref.layers):
        torch.testing.assert_close(k, layer.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, layer.values, atol=1e-4, rtol=1e-4)


def random_steps(seq, rng: random.Random, steps: int, *, crop: bool = True) -> Iterator[list[int]]:
    """Drive a target sequence the way the engine does, at random: prefill 5 tokens, then `steps`
    tree passes of 0-9 nodes, each committing a random path (or none); with `crop`, every fourth
    step also rolls back 0-2 tokens. Yields the committed tokens after each step."""
    committed = [rng.randrange(VOCAB) for _ in range(5)]
    seq.prefill(committed, logits="none")
    for step in range(steps):
        root = rng.randrange(VOCAB)
        tree = random_tree(rng, rng.randrange(0, 10), VOCAB)
        seq.forward_tree(root, tree)
        path = tree.path_to(rng.randrange(len(tree))) if len(tree) and rng.random() < 0.8 else ()
        seq.commit(path)
        committed += [root, *tree.tokens_of(path)]
        if crop and step % 4 == 3:  # occasionally roll back
            drop = rng.randrange(0, 3)
            seq.crop(len(committed) - drop)
            committed = committed[: len(committed) - drop]
        yield committed


def saved_training_setup(tmp_path, tokenizer, *, layers: int = 2, prompts: int = 6, stride: int = 5, words: int = 5):
    """A tiny Llama saved as a model directory (tokenizer included) and a JSONL prompt file of
    `prompts` word prompts, for `specula train` commands: (directory, model, data file)."""
    import json

    path = tmp_path / f"tiny{layers}"
    tokenizer.save_pretrained(path)
    model = tiny_model("llama", seed=3, layers=layers)
    model.save_pretrained(path)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * stride + k) % 90 + 2}" for k in range(words))}) + "\n"
                            for i in range(prompts)))
    return path, model, data


def output_text(tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after `prompt`, as vLLM and specula show an output: the text of the whole
    less the prompt's (a tokenizer that joins words by spaces starts it with one)."""
    def decode(tokens):
        return tokenizer.decode(list(tokens), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    return decode([*prompt, *ids])[len(decode(prompt)):]


def prompt_features(dec) -> list[torch.Tensor]:
    """The prompt features [len(prompt) - 1, k E] each request hands `dec`'s first drafter (a head's
    `observe_prompt`), as they come."""
    seen: list[torch.Tensor] = []
    drafter = dec.drafters[0]
    call = drafter.observe_prompt
    drafter.observe_prompt = lambda prompt, hidden, state: (seen.append(hidden.clone()), call(prompt, hidden, state))[1]
    return seen
