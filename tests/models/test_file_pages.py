"""A model whose linears were packed into new memory keeps none of its checkpoint's pages resident."""

import sys

import pytest
import torch
from torch import nn

from specula.models.file_pages import MappedPages, _mapped, file_mappings
from specula.models.loading import load_model
from specula.models.prepack import onednn_available

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps and smaps")


def rss(holds) -> tuple[int, int]:
    """(Rss summed, how many mappings) over this process's mappings for which holds(start, end, path)
    (/proc/self/smaps)."""
    total, found, inside = 0, 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = holds(start, end, fields[5] if len(fields) >= 6 else "")
            found += inside
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total, found


def resident_bytes(address: int) -> int:
    """Rss of the mapping that holds `address`."""
    total, found = rss(lambda start, end, _: start <= address < end)
    assert found == 1, f"no mapping holds {address:#x}"
    return total


def file_resident_bytes(path) -> int:
    """Rss of this process's mappings of the file `path`."""
    return rss(lambda start, end, name: name == str(path))[0]


@pytest.fixture
def saved(tmp_path, tiny_tokenizer):
    """A Qwen2 of 256-wide layers (whole pages in every linear weight) saved as safetensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    tiny_tokenizer.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    return tmp_path, model


def linear_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))


@linux
@pytest.mark.parametrize("how", [
    pytest.param({"linear_kernel": "onednn"}, marks=pytest.mark.skipif(not onednn_available(), reason="no oneDNN")),
    {"quantize": "int8", "linear_kernel": "aten"},
])
def test_a_model_whose_linears_were_packed_keeps_none_of_their_checkpoint_pages(saved, how):
    path, reference = saved
    model, _ = load_model(str(path), **how)
    checkpoint = (path / "model.safetensors").resolve()
    assert file_resident_bytes(checkpoint) < linear_bytes(reference) / 8  # each packing read them all
    ids = torch.tensor([[3, 17, 40, 2, 9]])
    with torch.inference_mode():
        if "quantize" not in how:  # float32 all the way: the same logits as the saved model's
            torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
        else:
            assert torch.isfinite(model(ids).logits).all()


@linux
def test_a_plain_float32_load_keeps_reading_its_checkpoint(saved):
    """aten's linears read the file's pages as they are (zero copy): nothing is released, and the
    detection the release relies on sees them."""
    path, reference = saved
    model, _ = load_model(str(path), linear_kernel="aten")
    ranges = file_mappings(clean=True)
    assert all(_mapped(m.weight, ranges) for m in model.modules() if isinstance(m, nn.Linear))
    with torch.inference_mode():
        model(torch.tensor([[3, 17, 40]]))  # every weight read
    assert file_resident_bytes((path / "model.safetensors").resolve()) > linear_bytes(reference) / 2


@linux
def test_release_unmaps_a_read_weight_and_keeps_its_values(tmp_path):
    file = tmp_path / "w.bin"
    values = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: whole pages inside
    values.numpy().tofile(file)
    weight = torch.from_file(str(file), shared=False, size=values.numel(), dtype=torch.float32)
    assert float(weight.sum()) == float(values.sum())  # every page read: resident
    before = resident_bytes(weight.data_ptr())
    released = MappedPages().release(weight)
    assert released >= 4 * (1 << 20) - 2 * 4096 and before >= released
    assert resident_bytes(weight.data_ptr()) <= before - released + 2 * 4096
    assert torch.equal(weight, values)  # read again from the file's pages
    assert MappedPages().release(values) == 0  # anonymous memory is left alone


@linux
def test_weights_in_no_file_mapping_read_no_smaps(monkeypatch):
    """/proc/self/smaps is slow to read (27 ms in a process holding the 1.5B): a model packed from memory
    of its own (a head, specula's prepared files loaded) never reads it."""
    from specula.models import file_pages

    asked = []
    real = file_pages.file_mappings
    monkeypatch.setattr(file_pages, "file_mappings", lambda clean=False: asked.append(clean) or real(clean))
    pages = MappedPages()
    assert pages.release(torch.randn(1 << 20)) == 0
    assert asked == [False]


@linux
def test_replacing_linears_lets_go_of_the_pages_each_old_weight_read(tmp_path):
    from specula.models.linears import replace_linears

    file = tmp_path / "w.bin"
    torch.randn(1024 * 1024).numpy().tofile(file)
    data = torch.from_file(str(file), shared=False, size=1024 * 1024, dtype=torch.float32)
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False))
    model[0].weight = nn.Parameter(data.view(1024, 1024), requires_grad=False)
    x = torch.randn(2, 1024)
    expected = model(x)

    def packed(old: nn.Linear) -> nn.Linear:  # a copy in memory of its own, as OneDNNLinear's reorder makes
        new = nn.Linear(1024, 1024, bias=False).requires_grad_(False)
        new.weight.copy_(old.weight)  # reads every page of the old weight: resident
        return new

    replace_linears(model, packed)
    assert resident_bytes(data.data_ptr()) < 1024 * 1024  # of 4 MiB read
    torch.testing.assert_close(model(x), expected)
    assert torch.equal(data.view(1024, 1024), model[0].weight)  # the file's values, read back from the page cache


@linux
def test_a_written_page_of_a_private_mapping_is_never_released(tmp_path):
    """A page of a private file mapping written in place is the process's own copy, not the file's:
    releasing it would bring the file's bytes back. Such a mapping is not among the clean ones."""
    file = tmp_path / "w.bin"
    torch.zeros(1 << 20).numpy().tofile(file)
    weight = torch.from_file(str(file), shared=False, size=1 << 20, dtype=torch.float32)
    assert _mapped(weight, file_mappings(clean=True))  # read only so far: clean
    weight[::1024] = 7.0  # one value a page: every page written (copy-on-write)
    assert not _mapped(weight, file_mappings(clean=True)) and _mapped(weight, file_mappings())
    assert MappedPages().release(weight) == 0
    assert float(weight[::1024].min()) == 7.0
