"""Helpers for the tool-calling tests: tools, and a word-level chat template that renders them (and the
tool-calling fields of messages) into the prompt."""

from __future__ import annotations

from serve_helpers import make_tokenizer

TOOL_TEMPLATE = (
    "{% if tools %}{% for t in tools %}w05 {{ t.function.name }} {% endfor %}{% endif %}"
    "{% for m in messages %}w02 {{ m['content'] }} "
    "{% for c in m.tool_calls or [] %}w08 {{ c.function.name }} {{ c.function.arguments.arg }} {% endfor %}"
    "{% if m.tool_call_id %}w09 {{ m.tool_call_id }} {% endif %}w03 {% endfor %}"
    "{% if add_generation_prompt %}w04{% endif %}"
)
"""Renders each tool's name (words w00..w95), an assistant's tool calls (the arguments object's `arg`, so
a call's JSON arguments must have been parsed) and a tool message's tool_call_id."""


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "description": f"the tool {name}"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool("w07", {"type": "object", "properties": {"arg": {"type": "string"}}}), tool("w11")]


def tool_tokenizer():
    """The server tests' word-level tokenizer with `TOOL_TEMPLATE`."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------- a model that calls a tool

WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                               "required": ["city"], "additionalProperties": False})
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SCRIPT = ["Let me check.", "<tool_call>", CALL, "</tool_call>"]
"""What the scripted model answers every chat prompt with, piece by piece (each piece one token)."""
SCRIPT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A chat template in the hermes style: tools as JSON, earlier tool calls as <tool_call> blocks."""
SCRIPT_VOCAB = 128


def script_tokenizer(script: list[str] = SCRIPT, special: tuple[str, ...] = ()):
    """A byte-level tokenizer (`grammar_kit`: every printable ASCII character and the newline a token, so
    llguidance can constrain it; </s> = EOS = 1) with the pieces of `script` as added tokens (as Qwen's
    <tool_call> is one), those of `special` as added special tokens (decoding with skip_special_tokens
    drops them, as some models' tool call tags), and `SCRIPT_TEMPLATE`."""
    from grammar_kit import byte_level_tokenizer

    tokenizer = byte_level_tokenizer([chr(c) for c in range(32, 127)] + ["\n"], [])
    tokenizer.add_tokens([piece for piece in script if piece not in special])
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.chat_template = SCRIPT_TEMPLATE
    assert len(tokenizer) <= SCRIPT_VOCAB
    return tokenizer


def scripted_model(tokenizer, script: list[str] = SCRIPT):
    """A model whose greedy answer to every chat prompt (ending "assistant:") is `script` then EOS: its
    next token depends on the last token alone (attention and MLP outputs zeroed, one-hot embeddings),
    and the output head maps each token to its successor (EOS for every token off the script). Small
    noise in the head keeps ties away where a constraint masks the successor out."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = [tokenizer.convert_tokens_to_ids(piece) for piece in script]
    chain = [tokenizer.encode(":", add_special_tokens=False)[-1], *ids, tokenizer.eos_token_id]
    successor = {a: b for a, b in zip(chain, chain[1:])}
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=SCRIPT_VOCAB, hidden_size=SCRIPT_VOCAB, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(SCRIPT_VOCAB))
        head = torch.randn(SCRIPT_VOCAB, SCRIPT_VOCAB) * 0.01
        for token in range(SCRIPT_VOCAB):
            head[successor.get(token, tokenizer.eos_token_id), token] += 1.0
        model.lm_head.weight.copy_(head)
    return model
