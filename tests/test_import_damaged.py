"""``datastates-hist import`` of damaged and crafted sources: a torch file whose
records are compressed is read bit-exact (not mapped), a damaged pickle is one line
naming the file, a transformers folder's JSON of the wrong shape is refused by name,
and a crafted DCP folder costs neither quadratic time nor memory of its claimed size."""

import dataclasses
import json
import os
import pickle
import re
import warnings
import zipfile

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli import EXIT_DAMAGED, EXIT_IO, EXIT_MISSING, EXIT_USAGE, main
from test_import_sources import dcp_folder, edit_metadata


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def rezip(source, target, compress_type=zipfile.ZIP_STORED, replace=None):
    """``source`` (a torch zip file) written again as ``target``: its records compressed
    with ``compress_type``, those named in ``replace`` (by their name's end) replaced."""
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w") as zout:
        for info in zin.infolist():
            data = next((v for k, v in (replace or {}).items() if info.filename.endswith(k)), None)
            zout.writestr(info.filename, zin.read(info.filename) if data is None else data,
                          compress_type=compress_type)
    return target


def test_compressed_records_are_read_bit_exact(tmp_path, capsys):
    torch.manual_seed(0)
    # random floats barely compress: a record's compressed bytes are as many as the tensor's
    state = {"w": torch.randn(4096), "b": torch.arange(10, dtype=torch.int64)}
    torch.save(state, tmp_path / "plain.pt")
    source = rezip(tmp_path / "plain.pt", tmp_path / "step_3.pt", zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(source) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_DEFLATED}
    assert cli(capsys, "import", tmp_path / "run", source)[0] == 0
    with dh.open(tmp_path / "run") as h:
        assert h.steps == [3]
        for name, t in state.items():
            got = h.read(name, 3)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_compressed_records_that_unpack_far_beyond_the_file_are_refused_unread(tmp_path, capsys):
    torch.save({"w": torch.zeros(25 * 2**20)}, tmp_path / "plain.pt")  # 100 MiB of zeros
    source = rezip(tmp_path / "plain.pt", tmp_path / "step_1.pt", zipfile.ZIP_DEFLATED)
    size = os.path.getsize(source)
    assert size < 2**20
    with zipfile.ZipFile(source) as z:
        unpacked = sum(i.file_size for i in z.infolist())
    assert cli(capsys, "import", tmp_path / "run", source) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {source}: its compressed records would expand to "
                        f"{unpacked} bytes from {size} bytes of file (more than {16 * size}): refused\n")


# data.pkl of a torch file, damaged so that torch's unpickler fails with each of these
DAMAGED_PICKLES = [
    (b"\x80\x02h\x63.", "KeyError"),          # a memo entry that was never stored
    (b"\x80\x02J\x01", "struct.error"),     # a 4-byte int cut short
    (b"\x80\x02K\x01K\x02\x86\x86\x86.", "IndexError"),  # tuples built from an empty stack
]


@pytest.mark.parametrize("pickled, raised", DAMAGED_PICKLES)
def test_a_damaged_pickle_is_one_line_naming_the_file(tmp_path, capsys, pickled, raised):
    torch.save({"w": torch.ones(3)}, tmp_path / "plain.pt")
    source = rezip(tmp_path / "plain.pt", tmp_path / "step_1.pt", replace={"data.pkl": pickled})
    assert cli(capsys, "import", tmp_path / "run", source) == (
        EXIT_IO, "", f"datastates-hist: cannot read {source}: damaged or not a torch file ({raised})\n")
    assert not (tmp_path / "run" / "steps").exists() or not any((tmp_path / "run" / "steps").iterdir())


def hf_folder(folder, **files):
    """A transformers folder of one safetensors shard listed by an index, and ``files``."""
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / "model-00001-of-00001.safetensors")
    files.setdefault("model.safetensors.index.json",
                     json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_transformers_json_of_the_wrong_shape_is_refused(tmp_path, capsys):
    listed = hf_folder(tmp_path / "checkpoint-1", **{"model.safetensors.index.json": "[1, 2]"})
    assert cli(capsys, "import", tmp_path / "run", listed) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {listed}: model.safetensors.index.json has no weight_map\n")
    deep = hf_folder(tmp_path / "checkpoint-2", **{"trainer_state.json": "[" * 100_000 + "]" * 100_000})
    assert cli(capsys, "import", tmp_path / "run", deep) == (
        EXIT_IO, "", f"datastates-hist: cannot read {deep / 'trainer_state.json'}: nested too deeply\n")
    assert cli(capsys, "import", tmp_path / "run", tmp_path / "checkpoint-3") == (
        EXIT_MISSING, "", f"datastates-hist: cannot import {tmp_path / 'checkpoint-3'}: there is no such file or folder\n")


def test_dcp_planner_paths_of_no_item_are_left_alone(tmp_path, capsys):
    folder = dcp_folder(tmp_path / "dcp_5", {"model": {"w": torch.arange(4.0)}})

    def crowd(metadata):  # 100,000 entries naming no item, each a path thousands of keys long
        long_path = ("k",) * 5000
        metadata.planner_data.update({f"ghost{n}": long_path for n in range(100_000)})
    edit_metadata(folder, crowd)
    assert cli(capsys, "import", tmp_path / "run", folder)[0] == 0
    with dh.open(tmp_path / "run") as h:
        assert torch.equal(h.read("w", 5), torch.arange(4.0))

    deep = dcp_folder(tmp_path / "dcp_6", {"model": {"w": torch.arange(4.0)}})
    edit_metadata(deep, lambda metadata: metadata.planner_data.update({"model.w": ("k",) * 101}))
    assert cli(capsys, "import", tmp_path / "run", deep) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {deep}: its metadata gives 'model.w' a path 101 keys deep "
        "(at most 100)\n")


def test_dcp_tiling_is_checked_without_memory_of_the_tensor(tmp_path, capsys):
    """Chunks of a tensor of 2**40 elements (claimed through a transform, so that its
    size is not bounded by the files' bytes) are checked on the grid of their own
    boundaries: an overlap found at once, where a mask of the elements would take a TiB."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    folder = dcp_folder(tmp_path / "dcp_7", {"model": {"w": torch.arange(4.0)}})

    def overlap(metadata):
        meta = metadata.state_dict_metadata["model.w"]
        entry = metadata.storage_data.pop(MetadataIndex("model.w", (0,)))
        entry.transform_descriptors = ["stream.zstd/1"]
        half = 2 ** 39
        meta.size = torch.Size([2 ** 40])
        meta.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([half + 1])),
                       ChunkStorageMetadata(torch.Size([half]), torch.Size([half - 1]))]
        for chunk in meta.chunks:
            metadata.storage_data[MetadataIndex("model.w", tuple(chunk.offsets))] = entry
    edit_metadata(folder, overlap)
    assert cli(capsys, "import", tmp_path / "run", folder) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {folder}: its metadata gives 'model.w' chunks that do not "
        "tile it (some of its elements covered twice, others by none): the rest would be uninitialised memory\n")


def test_values_the_store_cannot_hold_are_refused_by_write(tmp_path):
    """A tensor of more dimensions than every backend takes is refused when written,
    by name; a whole number beyond a float's range is kept exactly, its scalar an infinity."""
    model = torch.nn.Linear(2, 2)
    with dh.Checkpointer(tmp_path / "run") as ckpt:
        with pytest.raises(ValueError) as info:
            ckpt.write(0, model, t=torch.zeros([1] * 33))
        assert str(info.value) == "tensor 'extra/t' has 33 dimensions; a stored tensor has at most 32"
        ckpt.write(1, model, data={"big": 10 ** 400, "small": -(10 ** 400)})
    with dh.open(tmp_path / "run") as h:
        assert h.steps == [1]
        assert h.scalars().loc[1, "extra/data/big"] == float("inf")
        assert h.scalars().loc[1, "extra/data/small"] == float("-inf")
    with dh.Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.restore(1, model).extra["data"] == {"big": 10 ** 400, "small": -(10 ** 400)}


def test_dcp_storage_entries_sharing_bytes_are_refused(tmp_path, capsys):
    """An entry moved onto another tensor's bytes: DCP would load 'model.b' from 'model.w''s
    serialized tensor (its first values)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = dcp_folder(tmp_path / "dcp_7", {"model": {"w": torch.arange(8.0), "b": torch.ones(2)}})

    def shared(metadata):
        w = metadata.storage_data[MetadataIndex("model.w", (0,))]
        b = MetadataIndex("model.b", (0,))
        metadata.storage_data[b] = dataclasses.replace(metadata.storage_data[b], offset=w.offset, length=w.length)
    edit_metadata(folder, shared)
    code, out, err = cli(capsys, "import", tmp_path / "run", folder)
    assert (code, out) == (EXIT_USAGE, "")
    assert re.fullmatch(rf"datastates-hist: cannot import {re.escape(str(folder))}: the storage entries of "
                        r"'model\.(w|b)' and 'model\.(w|b)' read the same bytes of '[^']+\.distcp': one's bytes "
                        r"would be loaded as the other's\n", err), err
    assert not (tmp_path / "run").exists()


def test_an_import_refused_by_the_target_folder_leaves_it_as_it_was(tmp_path, capsys):
    """A folder with step data but no index is refused by the writer before anything is
    written: not even its lock file is left behind."""
    folder = tmp_path / "not_a_run"
    (folder / "steps").mkdir(parents=True)
    (folder / "steps" / "000000000001.h5").write_bytes(b"mine")
    torch.save({"w": torch.ones(2)}, tmp_path / "step_2.pt")
    code, out, err = cli(capsys, "import", folder, tmp_path / "step_2.pt")
    assert code == EXIT_DAMAGED and err.startswith(f"datastates-hist: {folder} holds 1 step(s) of data but no index")
    assert "nothing was changed" in err
    assert sorted(os.listdir(folder)) == ["steps"] and os.listdir(folder / "steps") == ["000000000001.h5"]


def test_a_plain_pickle_is_one_line_without_torch_warnings(tmp_path, capsys):
    source = tmp_path / "step_1.pt"
    with open(source, "wb") as f:
        pickle.dump({"w": [1, 2]}, f, protocol=4)  # no torch file: torch warns of the protocol, then fails
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning that reached the user would fail here
        assert cli(capsys, "import", tmp_path / "run", source) == (
            EXIT_IO, "", f"datastates-hist: cannot read {source}: damaged or not a torch file\n")
    assert sorted(os.listdir(tmp_path)) == ["step_1.pt"]
