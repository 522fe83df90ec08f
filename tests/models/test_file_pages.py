"""A model whose linears were packed into new memory keeps no view of its memory-mapped checkpoint."""

import sys

import pytest
import torch
from torch import nn

from tiny import tiny_model
from specula.models.file_pages import _mapped, copy_off_files, file_mappings, release_pages
from specula.models.loading import load_model
from specula.models.prepack import onednn_available

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps and smaps")


def mapped_names(model: nn.Module) -> list[str]:
    ranges = file_mappings()
    return [name for name, t in [*model.named_parameters(), *model.named_buffers()] if _mapped(t, ranges)]


def resident_bytes(address: int) -> int:
    """Rss of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def saved(tmp_path, tiny_tokenizer):
    tiny_tokenizer.save_pretrained(tmp_path)
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    return tmp_path, model


@linux
@pytest.mark.parametrize("how", [
    pytest.param({"linear_kernel": "onednn"}, marks=pytest.mark.skipif(not onednn_available(), reason="no oneDNN")),
    {"quantize": "int8", "linear_kernel": "aten"},
])
def test_a_model_with_packed_linears_holds_no_view_of_its_checkpoint(saved, how):
    path, reference = saved
    model, _ = load_model(str(path), **how)
    assert mapped_names(model) == []
    ids = torch.tensor([[3, 17, 40, 2, 9]])
    with torch.inference_mode():
        if "quantize" not in how:  # float32 all the way: the same logits as the saved model's
            torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
        else:
            assert torch.isfinite(model(ids).logits).all()


@linux
def test_a_plain_float32_load_keeps_reading_its_checkpoint(saved):
    """aten's linears read the file's pages as they are (zero copy): nothing is copied off, and the
    detection the other tests rely on sees them."""
    path, _ = saved
    model, _ = load_model(str(path), linear_kernel="aten")
    assert "model.embed_tokens.weight" in mapped_names(model)


@linux
def test_release_pages_unmaps_a_read_weight_and_keeps_its_values(tmp_path):
    file = tmp_path / "w.bin"
    values = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: whole pages inside
    values.numpy().tofile(file)
    weight = torch.from_file(str(file), shared=False, size=values.numel(), dtype=torch.float32)
    assert float(weight.sum()) == float(values.sum())  # every page read: resident
    before = resident_bytes(weight.data_ptr())
    released = release_pages(weight, file_mappings(clean=True))
    assert released >= 4 * (1 << 20) - 2 * 4096 and before >= released
    assert resident_bytes(weight.data_ptr()) <= before - released + 2 * 4096
    assert torch.equal(weight, values)  # read again from the file's pages
    assert release_pages(values, file_mappings()) == 0  # anonymous memory is left alone


@linux
def test_copy_off_files_copies_each_view_once_and_keeps_tied_weights_tied(tmp_path):
    file = tmp_path / "w.bin"
    torch.arange(64 * 8 + 8, dtype=torch.float32).numpy().tofile(file)
    data = torch.from_file(str(file), shared=False, size=64 * 8 + 8, dtype=torch.float32)
    model = nn.Module()
    model.embed = nn.Embedding(64, 8)
    model.head = nn.Linear(8, 64, bias=False)
    model.embed.weight = model.head.weight = nn.Parameter(data[:512].view(64, 8), requires_grad=False)
    model.register_buffer("scale", data[512:])
    own = nn.Parameter(torch.ones(3), requires_grad=False)
    model.own = own
    expected = {name: t.clone() for name, t in model.state_dict().items()}
    assert set(mapped_names(model)) == {"embed.weight", "scale"}  # named_parameters lists a tied weight once
    assert copy_off_files(model) == 4 * (512 + 8)
    assert mapped_names(model) == []
    assert model.embed.weight is model.head.weight  # still one parameter
    assert model.own is own and own.data_ptr() != 0
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name


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
    assert release_pages(weight, file_mappings(clean=True)) == 0
    assert float(weight[::1024].min()) == 7.0
