"""A tiny byte-level tokenizer that llguidance reads (JSON characters, a few merges), for the
constraint tests (the word-level test tokenizers carry no bytes a grammar could match)."""

from __future__ import annotations

from typing import Sequence

JSON_CHARS = list('{}[]":, abcdefghijklmnopqrstuvwxyz0123456789-.') + ["\n"]
JSON_MERGES = [('{', '"'), ('"', ':'), ('"', ','), ('"', '}'), ('n', 'a'), ('na', 'm'), ('nam', 'e'), ('a', 'g'),
               ('ag', 'e'), (' ', '"'), ('":', ' ')]
VOCAB = 64
"""Logit width of the tiny models paired with the tokenizer (its 60 tokens and 4 unused ids)."""
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ab", "cd", "abc"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
"""A JSON schema the tokenizer's characters can write."""


def constraint_kinds() -> dict:
    """A JSON schema, a regex and a Lark grammar the tokenizer can write, by kind (`specula.constraints.Constraint`)."""
    from specula.constraints import Constraint

    return {"schema": Constraint.json_schema(SCHEMA), "regex": Constraint.regex(r"[a-c]{2,6}-(x|yz)+\."),
            "grammar": Constraint.grammar('start: item ("," item)* "."\nitem: "ab" | "cd" | /[0-9]{1,3}/')}


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies are written in it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def byte_level_tokenizer(chars: list[str], merges: list[tuple[str, str]]):
    """A byte-level BPE fast tokenizer: ids 0 <s>, 1 </s> (EOS), then `chars`, then the merges."""
    return _bpe_tokenizer([c.encode() for c in chars], [(a.encode(), b.encode()) for a, b in merges])


def all_bytes_tokenizer(merges: Sequence[tuple[bytes, bytes]] = ()):
    """Byte-level BPE over the 256 bytes (ids 2..257), then `merges` (ids 258..): random ids spell unfinished and
    invalid UTF-8 as often as whole characters."""
    return _bpe_tokenizer([bytes([b]) for b in range(256)], merges)


def byte_merges(count: int) -> list[tuple[bytes, bytes]]:
    """`count` BPE merges that spell multi-byte characters (a 2-, 3- or 4-byte one whole or in part), then ASCII
    pairs."""
    merges: list[tuple[bytes, bytes]] = []
    for char in "\u00e9\u00fc\u00f1\u4e2d\u65e5\u2014\u20ac\U0001f600":
        code = char.encode()
        merges += [(code[:i], code[i:i + 1]) for i in range(1, len(code)) if (code[:i], code[i:i + 1]) not in merges]
    pairs = (bytes([a, b]) for a in b"etaoin s" for b in b"etaoin s")
    merges += [(pair[:1], pair[1:]) for pair in pairs][: count - len(merges)]
    return merges[:count]


def _bpe_tokenizer(pieces: Sequence[bytes], merges: Sequence[tuple[bytes, bytes]]):
    """Ids 0 <s>, 1 </s> (EOS), then `pieces`, then the merges (each of two pieces or merges before it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _byte_chars()

    def enc(piece: bytes) -> str:
        return "".join(table[b] for b in piece)

    vocab = {"<s>": 0, "</s>": 1}
    for piece in pieces:
        vocab[enc(piece)] = len(vocab)
    pairs = [(enc(a), enc(b)) for a, b in merges]
    for a, b in pairs:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
