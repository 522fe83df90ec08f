"""specula.models.loading: spec resolution, offline loading, draft/target compatibility, prompts."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from modelkit import ModelFactory, word_tokenizer

from specula.errors import ConfigError, IncompatibleModelsError, ModelNotFoundError, SpeculaError
from specula.models import install as inst
from specula.models.loading import apply_chat_template, check_compatible, load_model, load_tokenizer, resolve

WORDS = ["<unk>", "<pad>", "<eos>", "<bos>", "a", "b", "c", "d"]


# --------------------------------------------------------------------------- resolve


@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-1.5b", "QWEN2.5-Coder-0.5B"])
def test_alias_not_installed_error_prints_install_command(cache: Path, alias: str) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve(alias)
    assert f"specula models install {alias.lower()}" in str(err.value)


def test_alias_error_reaches_the_cli_as_one_line(cache: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What any command that loads a model prints when the alias is not installed."""
    import specula.cli as cli

    class _Parser:
        def parse_args(self, argv: list[str] | None) -> SimpleNamespace:
            return SimpleNamespace(handler=lambda args: load_model("smollm2-135m"))

    monkeypatch.setattr(cli, "build_parser", _Parser)
    assert cli.main([]) == 2
    assert capsys.readouterr().err == (
        "error: embedded model smollm2-135m is not installed (or not converted yet); run: "
        "specula models install smollm2-135m\n"
    )


def test_alias_resolves_to_converted_cache(make_model: ModelFactory, cache: Path) -> None:
    from modelkit import fake_converter

    make_model("fake-alias", [b"GGUF"])
    inst.install("fake-alias", progress=False, converter=fake_converter)
    resolved = resolve("fake-alias")
    assert resolved.kind == "embedded" and resolved.path == cache / "models" / "fake-alias"
    assert resolved.embedded is not None and resolved.name == "fake-alias"


def test_a_damaged_tokenizer_of_an_embedded_model_names_the_reinstall(make_model: ModelFactory, cache: Path,
                                                                      tmp_path: Path) -> None:
    """tokenizer.json damaged at the same size (too large to parse on every check): the load failed
    with JSON's message and no fix; files specula wrote are named damaged, with the reinstall."""
    from modelkit import fake_converter

    make_model("fake-tok", [b"GGUF"])
    inst.install("fake-tok", progress=False, converter=fake_converter)
    directory = cache / "models" / "fake-tok"
    word_tokenizer(["a", "b"]).save_pretrained(str(tmp_path / "tok"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / name, directory / name)
    load_tokenizer("fake-tok")
    tokenizer_json = directory / "tokenizer.json"
    tokenizer_json.write_bytes(b"X" + tokenizer_json.read_bytes()[1:])
    with pytest.raises(SpeculaError, match="truncated or damaged.*delete .*fake-tok and run specula models install "
                                           "fake-tok"):
        load_tokenizer("fake-tok")


def test_resolve_paths(tmp_path: Path, tiny_gguf: Path) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve(str(hf_dir)).kind == "directory"

    gguf = resolve(str(tiny_gguf))
    assert gguf.kind == "gguf" and gguf.gguf_file == tiny_gguf and gguf.path == tiny_gguf.parent
    assert resolve(str(tiny_gguf.parent)).kind == "gguf"  # a directory holding exactly one .gguf

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve(str(empty))
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="no such file or directory"):
        resolve("./definitely/not/here")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve(str(tmp_path / "notes.txt"))
    with pytest.raises(ConfigError):
        resolve("  ")


def test_hub_id_only_from_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    snapshot = hub / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)

    resolved = resolve("acme/tiny")
    assert resolved.kind == "hub" and resolved.path == snapshot and resolved.name == "acme/tiny"
    with pytest.raises(ModelNotFoundError) as err:
        resolve("acme/not-downloaded")
    message = str(err.value)
    assert "cannot download" in message and "smollm2-135m" in message and "specula models install" in message
    with pytest.raises(ModelNotFoundError, match="not an embedded alias"):
        resolve("gpt-7")


# --------------------------------------------------------------------------- load_model


def test_load_model_from_gguf_and_converted_dir_agree(tiny_gguf: Path, tmp_path: Path) -> None:
    model, tokenizer = load_model(str(tiny_gguf))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    converted = tmp_path / "converted"
    converted.mkdir()
    facts = inst.convert_gguf(tiny_gguf, converted, progress=False)
    assert facts["max_abs_logit_diff"] == 0.0
    model2, tokenizer2 = load_model(str(converted), attn_implementation="eager")
    assert model2.config._attn_implementation == "eager"
    ids = tokenizer.encode(" the hat", add_special_tokens=False)
    assert tokenizer2.encode(" the hat", add_special_tokens=False) == ids
    with torch.inference_mode():
        a = model(torch.tensor([ids])).logits
        b = model2(torch.tensor([ids])).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_load_model_bad_dtype(tiny_gguf: Path) -> None:
    with pytest.raises(ConfigError, match="unknown dtype"):
        load_model(str(tiny_gguf), dtype="float8")


def test_load_model_broken_directory_is_a_specula_error(tmp_path: Path) -> None:
    from specula.errors import SpeculaError

    from tiny import word_tokenizer

    broken = tmp_path / "broken"
    broken.mkdir()
    word_tokenizer(50, eos_token="w1").save_pretrained(broken)
    (broken / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SpeculaError, match="could not load model"):
        load_model(str(broken))


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_a_model_directory_without_tokenizer_files_is_refused_before_its_weights_load(tmp_path: Path, monkeypatch,
                                                                                      backend: str) -> None:
    """Found by transformers after the weights had loaded, it was a 5-line message about hub ids."""
    import transformers

    from specula.errors import SpeculaError
    from specula.models.loading import LoadConfig, load_backend
    from tiny import tiny_model, word_tokenizer

    tiny_model("llama").save_pretrained(tmp_path)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights were loaded"))
    for load in (lambda: load_model(str(tmp_path)), lambda: load_backend(str(tmp_path), LoadConfig(backend=backend))):
        with pytest.raises(SpeculaError, match="has no tokenizer files in .* copy the model's tokenizer files") as caught:
            load()
        assert "\n" not in str(caught.value)
    monkeypatch.undo()
    word_tokenizer(96, eos_token="w1").save_pretrained(tmp_path)  # with them, it loads
    assert load_model(str(tmp_path))[1] is not None


# --------------------------------------------------------------------------- check_compatible


def _fake_model(logits: int) -> SimpleNamespace:
    head = SimpleNamespace(weight=torch.empty(logits, 0))
    return SimpleNamespace(get_output_embeddings=lambda: head, config=SimpleNamespace(vocab_size=logits))


def test_compatible_tokenizers_pass_with_padded_heads() -> None:
    target = word_tokenizer(WORDS, name="big")
    draft = word_tokenizer(WORDS, name="small")
    check = check_compatible(target, draft, _fake_model(16), _fake_model(8))
    assert check.shared_size == len(WORDS)
    assert (check.target_logits, check.draft_logits) == (16, 8)


def test_extra_tokens_at_the_end_are_allowed() -> None:
    check = check_compatible(word_tokenizer([*WORDS, "e", "f"]), word_tokenizer(WORDS))
    assert check.shared_size == len(WORDS) and check.target_tokens == len(WORDS) + 2


def test_different_vocabulary_is_rejected_naming_both_models() -> None:
    swapped = [*WORDS[:4], "b", "a", *WORDS[6:]]
    with pytest.raises(IncompatibleModelsError) as err:
        check_compatible(word_tokenizer(WORDS, name="org/target-x"), word_tokenizer(swapped, name="org/draft-y"))
    message = str(err.value)
    assert "org/target-x" in message and "org/draft-y" in message
    assert "2 of 8 shared ids differ" in message and "id 4: 'a' vs 'b'" in message


def test_different_special_tokens_are_rejected() -> None:
    with pytest.raises(IncompatibleModelsError, match="eos 2 vs 1"):
        check_compatible(word_tokenizer(WORDS), word_tokenizer(WORDS, eos="<pad>"),
                         target_name="T", draft_name="D")
    with pytest.raises(IncompatibleModelsError, match=r"bos None vs 3"):
        check_compatible(word_tokenizer(WORDS), word_tokenizer(WORDS, bos="<bos>"))


def test_output_layer_narrower_than_shared_vocabulary_is_rejected() -> None:
    with pytest.raises(IncompatibleModelsError, match="has 6 logits"):
        check_compatible(word_tokenizer(WORDS), word_tokenizer(WORDS), _fake_model(8), _fake_model(6))


# --------------------------------------------------------------------------- prompts


def test_apply_chat_template(tiny_gguf: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=str(tiny_gguf))
    assert tokenizer.chat_template
    templated = apply_chat_template(tokenizer, "the a")
    expected = tokenizer.encode("<user>the a<|im_end|><assistant>", add_special_tokens=False)
    assert templated == expected
    assert apply_chat_template(tokenizer, [{"role": "user", "content": "the a"}]) == expected
    assert apply_chat_template(tokenizer, "the a", raw=True) == tokenizer.encode("the a")
    with pytest.raises(ConfigError, match="raw prompt must be a string"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "x"}], raw=True)
    with pytest.raises(ConfigError, match="role"):
        apply_chat_template(tokenizer, [{"text": "x"}])

    tokenizer.chat_template = None  # a base model: strings are encoded as they are
    assert apply_chat_template(tokenizer, "the a") == tokenizer.encode("the a")
    with pytest.raises(ConfigError, match="no chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "x"}])


def test_real_gguf_dir_copy_is_independent(tiny_gguf: Path, tmp_path: Path) -> None:
    """A GGUF copied elsewhere resolves to its new directory (the spec is a path, not a name)."""
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_gguf, copy)
    assert resolve(str(copy)).path == copy.parent


def _saved_tokenizer(tmp_path):
    """A word tokenizer with added tokens (special and not), saved as transformers saves one."""
    from transformers import AddedToken

    import tiny

    tokenizer = tiny.word_tokenizer(["w0", "w1", "w2", "hello", "world"], eos_token="<|end|>", pad_token="<|pad|>")
    tokenizer.add_tokens([AddedToken("<tool>", lstrip=True, normalized=False), "plain-added"])
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_added_tokens_read_from_the_head_of_tokenizer_json_give_the_same_tokenizer(tmp_path):
    """`load_tokenizer` hands transformers the added tokens it read from the file's head (transformers
    would parse the whole file again for them): the tokenizer is the one transformers builds alone."""
    from transformers import AutoTokenizer

    from specula.models.loading import added_tokens_of

    directory = _saved_tokenizer(tmp_path)
    added = added_tokens_of(directory)
    expected = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert added is not None and {t["content"] for t in added.values()} >= {"<|end|>", "<|pad|>", "<tool>", "plain-added"}
    assert {i: t.content for i, t in expected.added_tokens_decoder.items()} == {i: t["content"] for i, t in added.items()}
    got = load_tokenizer(str(directory))
    assert got.added_tokens_decoder == expected.added_tokens_decoder
    assert got.backend_tokenizer.to_str() == expected.backend_tokenizer.to_str()
    assert got.all_special_tokens == expected.all_special_tokens and got.get_vocab() == expected.get_vocab()
    assert got.init_kwargs == expected.init_kwargs and got.chat_template == expected.chat_template
    text = "hello <tool>world plain-added w2 <|end|>"
    assert got(text).input_ids == expected(text).input_ids
    assert got.decode(got(text).input_ids) == expected.decode(expected(text).input_ids)


def test_added_tokens_are_left_to_transformers_where_it_reads_them_elsewhere(tmp_path):
    from specula.models.loading import added_tokens_of

    directory = _saved_tokenizer(tmp_path)
    (directory / "special_tokens_map.json").write_text("{}")
    assert added_tokens_of(directory) is None  # the legacy files transformers reads with them
    (directory / "special_tokens_map.json").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"added_tokens_decoder": {}}))
    assert added_tokens_of(directory) is None  # the config holds them


@pytest.mark.parametrize("text", [
    '{"version": "1.0", "truncation": {"added_tokens": [{"id": 1, "content": "x"}]}, "added_tokens": []}',  # nested first
    '{"version": "1.0", "padding": null}',  # none
    '{"version": "1.0", "added_tokens": [{"id": "1", "content": "x"}]}',  # an id that is no int
    '{"version": "1.0", "added_tokens": [{"id": 1, "content": "x"}',  # cut short
])
def test_added_tokens_from_a_head_that_does_not_hold_them_plainly_are_none(tmp_path, text):
    from specula.models.loading import added_tokens_of

    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text(text)
    assert added_tokens_of(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [{"id": 4, "content": "x", "special": true}]}')
    assert added_tokens_of(tmp_path) == {4: {"content": "x", "special": True}}


# --------------------------------------------------------------------------- _architecture


@pytest.fixture
def autoconfig_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """The arguments of every `AutoConfig.from_pretrained` call from here on (calls go through)."""
    import transformers

    real = transformers.AutoConfig.from_pretrained
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", counted)
    return calls


def test_architecture_reads_a_directorys_config_without_transformers_and_falls_back_to_it(
        tiny_gguf: Path, tmp_path: Path, autoconfig_calls: list) -> None:
    """A directory's config.json names its class as read (AutoConfig not called); a .gguf, or a
    config naming no class, goes through AutoConfig (its model type's class) as before."""
    from specula.models.loading import _architecture

    converted = tmp_path / "converted"
    converted.mkdir()
    inst.convert_gguf(tiny_gguf, converted, progress=False)
    calls = autoconfig_calls
    calls.clear()
    from_gguf = _architecture(resolve(str(tiny_gguf)))
    assert from_gguf == "LlamaForCausalLM" and len(calls) == 1  # a .gguf: through AutoConfig
    calls.clear()
    assert _architecture(resolve(str(converted))) == from_gguf and calls == []
    config = json.loads((converted / "config.json").read_text())
    for named in (None, []):  # no class named: transformers reads it (its model type's class)
        config["architectures"] = named
        (converted / "config.json").write_text(json.dumps(config))
        assert _architecture(resolve(str(converted))) == "LlamaForCausalLM"
    assert len(calls) == 2
    config["architectures"] = ["MyForCausalLM", "LlamaForCausalLM"]
    (converted / "config.json").write_text(json.dumps(config))
    assert _architecture(resolve(str(converted))) == "MyForCausalLM" and len(calls) == 2


# --------------------------------------------------------------------------- config_stand_in


def _model_dir(tmp_path: Path, arch: str, tokenizer_class: str | None) -> Path:
    """`_saved_tokenizer` beside a tiny `arch` model's config.json, the tokenizer config naming
    `tokenizer_class` (None: naming none)."""
    import tiny

    directory = _saved_tokenizer(tmp_path / f"{arch}-{tokenizer_class}")
    tiny.tiny_model(arch).config.save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("arch, tokenizer_class", [
    ("llama", "TokenizersBackend"), ("llama", "LlamaTokenizer"), ("llama", "PreTrainedTokenizerFast"),
    ("qwen2", "Qwen2Tokenizer"), ("qwen2", "TokenizersBackend"), ("gpt2", "GPT2Tokenizer"),
    ("gpt2", "LlamaTokenizerFast")])
def test_config_stand_in_gives_the_tokenizer_transformers_builds_from_the_config(
        tmp_path: Path, autoconfig_calls: list, arch: str, tokenizer_class: str) -> None:
    """With the config's facts read as JSON, `AutoTokenizer` picks the class, and builds the tokenizer,
    that it picks and builds from the config it would build itself (which it then does not build)."""
    from transformers import AutoTokenizer

    directory = _model_dir(tmp_path, arch, tokenizer_class)
    expected = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert len(autoconfig_calls) == 1  # transformers alone builds the config
    got = load_tokenizer(str(directory))
    assert len(autoconfig_calls) == 1
    assert type(got) is type(expected)
    assert got.backend_tokenizer.to_str() == expected.backend_tokenizer.to_str()
    assert got.added_tokens_decoder == expected.added_tokens_decoder
    assert got.all_special_tokens == expected.all_special_tokens and got.get_vocab() == expected.get_vocab()
    assert got.init_kwargs == expected.init_kwargs and got.chat_template == expected.chat_template
    text = "hello <tool>world plain-added w2 <|end|>"
    assert got(text).input_ids == expected(text).input_ids
    assert got.decode(got(text).input_ids) == expected.decode(expected(text).input_ids)


def test_config_stand_in_holds_what_autoconfig_would_and_is_none_where_transformers_must_read(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from specula.models.loading import config_stand_in

    directory = _model_dir(tmp_path, "llama", "TokenizersBackend")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"model_name": "m", "tokenizer_class": "GPT2Tokenizer",
                                                                "_name_or_path": "someone/else"}))
    stand_in, real = config_stand_in(directory), AutoConfig.from_pretrained(str(directory), local_files_only=True)
    for name in ("model_type", "_name_or_path", "tokenizer_class", "model_name"):
        assert getattr(stand_in, name) == getattr(real, name), name
    (directory / "config.json").write_text(json.dumps(config))
    plain = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    assert not hasattr(config_stand_in(directory), "model_name") and not hasattr(plain, "model_name")
    for change in ({"model_type": "no-such-type"}, {"model_type": None}, {"auto_map": {"AutoConfig": "x.Y"}}):
        (directory / "config.json").write_text(json.dumps(config | change))
        assert config_stand_in(directory) is None, change
    (directory / "config.json").write_text(json.dumps(config))
    assert config_stand_in(directory) is not None
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    for change in ({"tokenizer_class": None}, {"auto_map": {"AutoTokenizer": ["x.Y", None]}}):
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | change))
        assert config_stand_in(directory) is None, change
    (directory / "config.json").unlink()
    assert config_stand_in(directory) is None


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_two_ggufs_in_one_folder_get_their_own_cost_keys(tmp_path: Path, monkeypatch, backend: str) -> None:
    """A GGUF's config names only its folder, which may hold several models of one shape (two
    quantisations, two fine-tunes): the cost key names the file, so one's curve is never the other's."""
    from specula.models.loading import LoadConfig, load_backend
    from modelkit import write_tiny_gguf

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "models"
    folder.mkdir()
    keys = []
    for name, seed in (("a.gguf", 0), ("b.gguf", 1)):
        write_tiny_gguf(folder / name, seed=seed)
        target, _ = load_backend(str(folder / name), LoadConfig(backend=backend, linear_kernel="aten"))
        keys.append(target.cost_key())
    assert keys[0]["model"] == str((folder / "a.gguf").resolve()) and keys[0] != keys[1]


@pytest.mark.parametrize("config", [{"hidden_act": "gelu_pytorch_tanh"},
                                    {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100.0}}])
def test_auto_backend_runs_what_the_native_decoder_refuses_on_hugging_face(tmp_path: Path, capsys, config) -> None:
    """A Llama the native decoder cannot run as transformers does (another activation, dynamic RoPE):
    `--backend auto` loads it with the Hugging Face backend, as it would another architecture,
    instead of failing with "use --backend hf"; `--backend native` still says why not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specula.models.hf import HFCausalLM
    from specula.models.loading import LoadConfig, load_backend
    from specula.models.native import NativeUnsupported
    from tiny import word_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                         max_position_embeddings=64, **config)).eval()
    model.save_pretrained(tmp_path)
    word_tokenizer(50, eos_token="w1").save_pretrained(tmp_path)
    backend, _ = load_backend(str(tmp_path), LoadConfig(backend="auto"))
    err = capsys.readouterr().err  # the reason, not the advice to do what auto did (use backend="hf")
    assert isinstance(backend, HFCausalLM) and "runs on the Hugging Face backend (" in err and "use backend" not in err
    prompt = [3, 9, 4, 20, 7]
    torch.testing.assert_close(backend.new_sequence().prefill(prompt, logits="all"), model(torch.tensor([prompt])).logits[0],
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(NativeUnsupported, match='use backend="hf"$'):
        load_backend(str(tmp_path), LoadConfig(backend="native"))


def test_a_gguf_beside_another_models_tokenizer_files_gets_its_own_tokenizer(tiny_gguf: Path, tmp_path: Path) -> None:
    """transformers prefers a folder's tokenizer files to the GGUF's own: a GGUF kept beside another
    model's files got that model's tokenizer (other ids for the same text)."""
    import shutil

    from tiny import word_tokenizer

    folder = tmp_path / "beside"
    folder.mkdir()
    shutil.copy(tiny_gguf, folder / "model.gguf")
    word_tokenizer(50, eos_token="w1").save_pretrained(folder)
    alone, beside = load_tokenizer(str(tiny_gguf)), load_tokenizer(str(folder / "model.gguf"))
    assert len(beside) == len(alone) and beside.encode(" the hat") == alone.encode(" the hat")


def test_a_split_gguf_part_or_an_incomplete_checkpoint_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    """One part of llama.cpp's split GGUF, or a checkpoint missing weights, loaded with random values
    for what it lacked; both are refused in one line naming the fix."""
    import shutil

    from safetensors.torch import load_file, save_file

    part = tmp_path / "split" / "tiny-00001-of-00002.gguf"
    part.parent.mkdir()
    shutil.copy(tiny_gguf, part)
    for spec in (part, part.parent):
        with pytest.raises(ModelNotFoundError, match="one part of a split GGUF.*llama-gguf-split --merge"):
            resolve(str(spec))
    converted = tmp_path / "converted"
    converted.mkdir()
    inst.convert_gguf(tiny_gguf, converted, progress=False)
    weights = load_file(str(converted / "model.safetensors"))
    dropped = next(name for name in weights if "layers.1." in name)
    save_file({k: v for k, v in weights.items() if k != dropped}, str(converted / "model.safetensors"))
    with pytest.raises(SpeculaError, match=f"lacks 1 of its weights \\(e.g. {re.escape(dropped)}\\)"):
        load_model(str(converted))


def test_a_quiet_conversion_draws_no_progress_bar(tiny_gguf: Path, tmp_path: Path, capsys) -> None:
    """`models install --quiet` still drew transformers' GGUF loader bar (its own tqdm)."""
    out = tmp_path / "converted"
    out.mkdir()
    capsys.readouterr()
    inst.convert_gguf(tiny_gguf, out, progress=False)
    assert "GGUF tensors" not in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["gguf header", "safetensors"])
def test_a_truncated_model_file_is_one_line_naming_the_fix(tiny_gguf: Path, tmp_path: Path, damage: str) -> None:
    """A GGUF cut inside its header (struct.error) or a damaged safetensors file (SafetensorError)
    raised a traceback; both read as a SpeculaError naming the file and the fix."""
    import shutil

    if damage == "gguf header":
        spec = tmp_path / "cut.gguf"
        spec.write_bytes(tiny_gguf.read_bytes()[:600])
    else:
        spec = tmp_path / "converted"
        spec.mkdir()
        inst.convert_gguf(tiny_gguf, spec, progress=False)
        weights = spec / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpeculaError, match="truncated or damaged.*again"):
        load_model(str(spec))


def test_cuda_graphs_asked_for_on_the_hugging_face_backend_are_refused_before_its_load(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """`set_cuda_graphs(True)` (or SPECULA_CUDA_GRAPHS=1) with backend="hf" on CUDA ran every pass eagerly without a
    word (that backend has no graph path); auto choosing hf for an architecture the native decoder lacks, too."""
    from specula.models import device
    from specula.models.loading import LoadConfig, load_backend
    from tiny import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    word_tokenizer(WORDS).save_pretrained(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("specula.models.loading.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(device, "_CUDA_GRAPHS", True)  # set_cuda_graphs(True)
    with pytest.raises(ConfigError) as caught:
        load_backend(str(tmp_path), LoadConfig(backend="hf", device="cuda"))
    assert str(caught.value) == (
        f'set_cuda_graphs(True) asks for CUDA graphs, which only the native backend has, and {tmp_path.name} runs '
        'on backend="hf"; drop set_cuda_graphs(True), or use backend="native"'), caught.value
    monkeypatch.setattr(device, "_CUDA_GRAPHS", None)
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "on")
    monkeypatch.setattr("specula.models.loading._architecture", lambda resolved: "GPT2LMHeadModel")  # auto: hf
    with pytest.raises(ConfigError, match=r"^SPECULA_CUDA_GRAPHS=on asks .* runs on backend=\"hf\"; unset "
                                          r"SPECULA_CUDA_GRAPHS \(or set it to 0\)$"):
        load_backend(str(tmp_path), LoadConfig(device="cuda"))


def test_cuda_graphs_asked_for_in_the_library_on_the_cpu_are_refused_before_the_load(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """`set_cuda_graphs(True)` (or SPECULA_CUDA_GRAPHS=1) before a load on the CPU ran every pass eagerly without a
    word (the command line refused its --cuda-graphs so, the library did not); left to the default, it loads."""
    from specula.models import device
    from specula.models.loading import LoadConfig, load_backend
    from tiny import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    word_tokenizer(WORDS).save_pretrained(str(tmp_path))
    monkeypatch.setattr(device, "_CUDA_GRAPHS", True)  # set_cuda_graphs(True)
    with pytest.raises(ConfigError) as caught:
        load_backend(str(tmp_path), LoadConfig(device="cpu"))
    assert str(caught.value) == (
        "set_cuda_graphs(True) asks for CUDA graphs of the native backend's passes on a CUDA device, and this run is "
        'on cpu (device="cpu"); drop set_cuda_graphs(True), or pass device="cuda" on a machine with a GPU')
    monkeypatch.setattr(device, "_CUDA_GRAPHS", None)
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "1")
    with pytest.raises(ConfigError, match=r"^SPECULA_CUDA_GRAPHS=1 asks .* on cpu \(device=\"auto\"\); unset "
                                          r"SPECULA_CUDA_GRAPHS \(or set it to 0\), or pass device=\"cuda\""):
        load_backend(str(tmp_path), LoadConfig())
    monkeypatch.delenv("SPECULA_CUDA_GRAPHS")
    model, _ = load_backend(str(tmp_path), LoadConfig(device="cpu"))
    assert model is not None
