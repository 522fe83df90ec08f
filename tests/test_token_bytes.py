"""`specula.token_bytes`: the bytes each token stands for, for byte-level BPE, SentencePiece byte
fallback and other tokenizers, built offline."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny import word_tokenizer
from specula.token_bytes import TokenBytes, byte_level_alphabet

TEXT = "héllo wörld 日本語\n  def f(): return 1"


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import ByteLevelBPETokenizer

    backend = ByteLevelBPETokenizer()
    backend.train_from_iterator(["hello world, def f(): return 1", "wörld héllo"], vocab_size=300, min_frequency=1,
                                special_tokens=["<|end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer, eos_token="<|end|>")


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ["▁", "h", "é", "l", "o", "w", "ö", "r", "d", "e", "f", "(", ")", ":", "t", "u", "n", "1",
                  "▁héllo", "▁wörld", "▁def", "▁return"]:
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


def test_the_byte_level_alphabet_covers_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n") and alphabet["a"] == ord("a")


def test_byte_level_tokens_join_to_the_texts_bytes_even_inside_a_character():
    tok = byte_level_tokenizer()
    tb = TokenBytes(tok)
    assert tb.kind == "byte-level"
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(tb(i) for i in ids) == TEXT.encode()
    partial = [i for i in ids if tb(i).decode("utf-8", errors="replace") != tb(i).decode("utf-8", errors="ignore")]
    assert partial, "the CJK text should split inside a character"
    assert all("\ufffd" in tb.text(i) for i in partial)
    assert tb(tok.eos_token_id) == b"<|end|>"


def test_byte_fallback_pieces_give_their_byte_and_a_space_for_the_marker():
    tok = byte_fallback_tokenizer()
    tb = TokenBytes(tok)
    assert tb.kind == "byte-fallback"
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # 日本語 and \n fall back to bytes
    assert b"".join(tb(i) for i in ids) == (" " + TEXT).encode()  # Metaspace's leading space is the first token's
    assert tb(tok.convert_tokens_to_ids("<0x0A>")) == b"\n"


def test_other_tokenizers_give_each_tokens_own_decoding():
    tok = word_tokenizer(8, decoder=True, unk_token="w0", eos_token="w1")
    tb = TokenBytes(tok)
    assert tb.kind == "text"
    assert [tb(i) for i in range(2, 5)] == [tok.decode([i]).encode() for i in range(2, 5)] == [b"w2", b"w3", b"w4"]


def test_completions_logprobs_offsets_index_the_text_and_partial_tokens_keep_their_own_keys():
    """text_offset indexes the returned text, which skips special tokens (an EOS or BOS added no
    characters there); a token inside a character is labelled by its bytes ("bytes:\\xe6..."), so
    alternatives that are parts of different characters do not collapse into one U+FFFD key."""
    from specula.logprobs import TokenLogprob
    from specula.serve.protocol import CompletionLogprobs

    tok = byte_level_tokenizer()
    tb = TokenBytes(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    eos = tok.eos_token_id
    stream = [ids[0], eos, *ids[1:]]
    partial = [i for i in ids if tb.label(i).startswith("bytes:")]
    assert partial and all(tb.label(i) == "bytes:" + "".join(f"\\x{b:02x}" for b in tb(i)) for i in partial)
    entries = [TokenLogprob(t, -1.0, 0, ((partial[0], -0.5), (partial[-1], -0.7), (t, -1.0))) for t in stream]
    out = CompletionLogprobs(tb).add(stream, entries)
    text = tok.decode(stream, skip_special_tokens=True)
    for token, label, offset in zip(stream, out["tokens"], out["text_offset"]):
        if not tb.special(token) and not label.startswith("bytes:"):
            assert text[offset:offset + len(label)] == label, (label, offset)
    assert out["text_offset"][1] == out["text_offset"][2]  # the EOS adds nothing to the text
    if tb.label(partial[0]) != tb.label(partial[-1]):
        assert all(len(top) >= 2 for top in out["top_logprobs"])  # both partial alternatives kept
