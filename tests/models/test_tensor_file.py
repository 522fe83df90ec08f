"""The tensor file (`specula.models.tensor_file`): tensors built inside the file and tensors copied
in read back equal, in place, stored once; a file that is not a whole one is refused; without
preallocation (or when it fails) the writer falls back to memory and says why."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from specula.models import tensor_file
from specula.models.tensor_file import HEADER_BYTES, TensorFileError, TensorFileWriter, map_tensors, read_index


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "i8": torch.randint(-128, 127, (7,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (2, 2, 3), dtype=torch.uint8, generator=g),
        "bf16": torch.randn(4, generator=g).to(torch.bfloat16),
        "long": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "none": torch.empty(0, 4),
        "strided": torch.randn(4, 6, generator=g).t(),  # not contiguous: copied as a contiguous tensor
    }


def test_tensors_made_in_the_file_and_copied_in_read_back_equal(tmp_path):
    path = tmp_path / "t.bin"
    with TensorFileWriter(path) as writer:
        big = writer.empty((300, 17), torch.float32)
        big.copy_(torch.arange(300 * 17, dtype=torch.float32).view(300, 17))
        nibbles = writer.empty((1000,), torch.uint8)
        nibbles.fill_(7)
        writer.add("big", big)
        writer.add("nibbles", nibbles)
        writer.add("row", big[5])  # a view inside a region: recorded in place too
        for name, tensor in _tensors().items():
            writer.add(name, tensor)
        index = writer.finish()
    assert writer.in_memory == 0 and writer.error is None
    assert index == read_index(path)
    # the regions are page-aligned and were not copied again: the view points into its region
    assert index["big"]["offset"] % mmap.ALLOCATIONGRANULARITY == 0 and index["big"]["offset"] >= HEADER_BYTES
    assert index["row"]["offset"] == index["big"]["offset"] + 5 * 17 * 4
    loaded = map_tensors(path)
    assert set(loaded) == {"big", "nibbles", "row", *_tensors()}
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["nibbles"], torch.full((1000,), 7, dtype=torch.uint8))
    assert torch.equal(loaded["row"], big[5])
    for name, tensor in _tensors().items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name
    # every copied tensor on a 64-byte boundary
    assert all(entry["offset"] % tensor_file.ALIGN == 0 for name, entry in index.items() if name != "row")


def test_a_large_tensor_is_copied_into_a_page_aligned_region(tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_file, "_COPY_MAPPED", 4096)
    small, large = torch.randn(8), torch.randn(64, 64)  # 32 B, 16 KiB
    with TensorFileWriter(tmp_path / "t.bin") as writer:
        writer.add("small", small)
        writer.add("large", large)
        writer.add("large again", large)
        index = writer.finish()
    assert index["small"]["offset"] == HEADER_BYTES
    assert index["large"]["offset"] % mmap.ALLOCATIONGRANULARITY == 0 and index["large"]["offset"] > HEADER_BYTES
    assert index["large again"]["offset"] == index["large"]["offset"]
    loaded = map_tensors(tmp_path / "t.bin")
    assert torch.equal(loaded["large"], large) and torch.equal(loaded["small"], small)


def test_a_tensor_named_twice_is_stored_once(tmp_path):
    shared = torch.randn(64)
    with TensorFileWriter(tmp_path / "t.bin") as writer:
        writer.add("a", shared)
        writer.add("b", shared)
        index = writer.finish()
        with pytest.raises(ValueError, match="added twice"):
            writer.add("a", shared)
    assert index["a"]["offset"] == index["b"]["offset"]
    loaded = map_tensors(tmp_path / "t.bin")
    assert torch.equal(loaded["a"], shared) and torch.equal(loaded["b"], shared)


def test_temporaries_at_a_reused_address_are_not_taken_for_one_tensor(tmp_path):
    gen = torch.Generator().manual_seed(1)
    bases = [torch.randn(16, 16, generator=gen) for _ in range(4)]
    with TensorFileWriter(tmp_path / "t.bin") as writer:
        for i, base in enumerate(bases[:2]):
            writer.add(f"strided{i}", base.t())  # a contiguous copy made and dropped inside add
        for i, base in enumerate(bases[2:]):
            writer.add(f"fresh{i}", base * 2)  # a caller's temporary, freed after the call
        writer.finish()
    loaded = map_tensors(tmp_path / "t.bin")
    assert torch.equal(loaded["strided0"], bases[0].t()) and torch.equal(loaded["strided1"], bases[1].t())
    assert torch.equal(loaded["fresh0"], bases[2] * 2) and torch.equal(loaded["fresh1"], bases[3] * 2)


def test_the_mapping_is_private_and_outlives_the_writer(tmp_path):
    path = tmp_path / "t.bin"
    with TensorFileWriter(path) as writer:
        made = writer.empty((256,), torch.float32)
        made.fill_(1.0)
        writer.add("w", made)
        writer.finish()
    loaded = map_tensors(path)
    loaded["w"].fill_(3.0)  # copy-on-write: the file keeps its bytes
    assert torch.equal(map_tensors(path)["w"], torch.ones(256))
    os.unlink(path)
    assert float(made.sum()) == 256.0  # a tensor handed out stays valid after close and deletion


def test_an_existing_file_is_not_overwritten(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"keep")
    with pytest.raises(FileExistsError):
        TensorFileWriter(tmp_path / "t.bin")
    assert (tmp_path / "t.bin").read_bytes() == b"keep"


def _whole(path) -> bytes:
    with TensorFileWriter(path) as writer:
        writer.add("w", torch.randn(100))
        writer.finish()
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["zeros", "truncated", "no index end", "index not json", "tensor past the data",
                                    "torch archive", "empty"])
def test_a_file_that_is_not_a_whole_one_is_refused(tmp_path, damage):
    path = tmp_path / "t.bin"
    data = _whole(path)
    tail = len(tensor_file.MAGIC) + 8
    length = int.from_bytes(data[-tail:-tail + 8], "little")
    if damage == "zeros":
        data = bytes(len(data))
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "no index end":
        data = data[:-1]
    elif damage == "index not json":
        start = len(data) - tail - length
        data = data[:start] + b"{" * length + data[start + length:]
    elif damage == "tensor past the data":
        start = len(data) - tail - length
        index = data[start:start + length].replace(b'"shape": [100]', b'"shape": [999]')
        data = data[:start] + index + len(index).to_bytes(8, "little") + tensor_file.MAGIC
    elif damage == "torch archive":
        path.unlink()
        torch.save({"w": torch.randn(100)}, path)
        data = path.read_bytes()
    else:
        data = b""
    path.write_bytes(data)
    with pytest.raises(TensorFileError):
        map_tensors(path)


def test_without_preallocation_tensors_are_made_in_memory_and_copied(tmp_path, monkeypatch):
    monkeypatch.delattr(tensor_file.os, "posix_fallocate")
    monkeypatch.setattr(tensor_file, "_COPY_MAPPED", 64)
    large = torch.randn(32, 32)
    with TensorFileWriter(tmp_path / "t.bin") as writer:
        made = writer.empty((10, 10), torch.float32)
        made.fill_(2.0)
        writer.add("w", made)
        writer.add("large", large)  # written, not mapped
        writer.finish()
    assert writer.in_memory == 400 and writer.error is None
    loaded = map_tensors(tmp_path / "t.bin")
    assert torch.equal(loaded["w"], torch.full((10, 10), 2.0)) and torch.equal(loaded["large"], large)


def test_a_failed_preallocation_falls_back_and_fails_the_file(tmp_path, monkeypatch):
    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tensor_file.os, "posix_fallocate", full_disk)
    with TensorFileWriter(tmp_path / "t.bin") as writer:
        made = writer.empty((8,), torch.int8)
        made.fill_(1)  # usable memory all the same
        writer.add("w", made)
        with pytest.raises(OSError, match="No space left"):
            writer.finish()
    assert writer.in_memory == 8 and int(made.sum()) == 8


def test_a_file_system_that_cannot_preallocate_still_gets_its_file(tmp_path, monkeypatch):
    import errno

    def unsupported(*args):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(tensor_file.os, "posix_fallocate", unsupported)
    with TensorFileWriter(tmp_path / "t.bin") as writer:
        made = writer.empty((16,), torch.float32)
        made.fill_(4.0)
        later = writer.empty((4,), torch.int8)  # not tried again
        later.fill_(-1)
        writer.add("w", made)
        writer.add("later", later)
        writer.finish()  # no error: the tensors were written instead
    assert writer.error is None and writer.in_memory == 68
    loaded = map_tensors(tmp_path / "t.bin")
    assert torch.equal(loaded["w"], torch.full((16,), 4.0)) and torch.equal(loaded["later"], later)

