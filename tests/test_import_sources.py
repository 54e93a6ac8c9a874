"""``datastates-hist import``: histories built from checkpoints the libraries wrote themselves
(torch.save, safetensors, transformers' Trainer and save_pretrained, torch.distributed.checkpoint),
read back bit-exact through the History, diff, trace and xarray; sources that could run code refused."""

import json
import os
import pickle
import warnings

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli import EXIT_IO, EXIT_USAGE, main
from datastates_hist.importing.reading import load_torch
from datastates_hist.importing.sources import find_sources


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def train_plain(folder):
    """step_000010.pt and step_000020.pt (model, optimizer, epoch), weights_30.pt (a state dict),
    w_40.safetensors, dcp_50 (a DCP folder of model and optimizer)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    paths = []
    for step in (10, 20, 30, 40, 50):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        if step <= 20:
            paths.append(os.path.join(folder, f"step_{step:06d}.pt"))
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": step // 10,
                        "step": step}, paths[-1])
        elif step == 30:
            paths.append(os.path.join(folder, "weights_30.pt"))
            torch.save(model.state_dict(), paths[-1])
        elif step == 40:
            paths.append(os.path.join(folder, "w_40.safetensors"))
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, paths[-1])
        else:
            paths.append(os.path.join(folder, "dcp_50"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=paths[-1],
                         no_dist=True)
    return paths


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.arange(i, i + 16) % 64
        return {"input_ids": ids, "labels": ids}


def train_transformers(folder):
    """A real Trainer run of a tiny random GPT-2 saving checkpoint-1 and checkpoint-2 (weights,
    optimizer, scheduler, RNG, trainer state), then save_pretrained into pretrained-3, and in
    shards (with their index) into sharded-4."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    args = TrainingArguments(folder, max_steps=2, save_steps=1, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Numbers()).train()
    model.save_pretrained(os.path.join(folder, "pretrained-3"))
    model.save_pretrained(os.path.join(folder, "sharded-4"), max_shard_size="40KB")
    assert "model.safetensors.index.json" in os.listdir(os.path.join(folder, "sharded-4"))
    return [os.path.join(folder, name) for name in ("checkpoint-1", "checkpoint-2", "pretrained-3", "sharded-4")]


@pytest.fixture(scope="module")
def plain_sources(tmp_path_factory):
    return train_plain(str(tmp_path_factory.mktemp("plain")))


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory):
    return train_transformers(str(tmp_path_factory.mktemp("hf")))


def safetensors_of(path):
    from safetensors.torch import load_file

    return load_file(path)


def model_of(path):
    """The model tensors of a source, read with the libraries' own loaders."""
    import torch.distributed.checkpoint as dcp

    if path.endswith(".safetensors"):
        return safetensors_of(path)
    if path.endswith("dcp_50"):
        out = {"model.0.weight": torch.empty(3, 4), "model.0.bias": torch.empty(3),
               "model.1.weight": torch.empty(2, 3), "model.1.bias": torch.empty(2)}
        with warnings.catch_warnings():  # no process group: one process, as intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, checkpoint_id=path, no_dist=True)
        return {k.removeprefix("model."): v for k, v in out.items()}
    if os.path.isdir(path):  # a transformers folder: one file or shards
        return {k: v for name in sorted(os.listdir(path)) if name.endswith(".safetensors")
                for k, v in safetensors_of(os.path.join(path, name)).items()}
    obj = torch.load(path, weights_only=True)
    return obj.get("model", obj)


def assert_bit_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_import_plain_sources(tmp_path, plain_sources, backend, capsys):
    run = tmp_path / "run"
    code, out, err = cli(capsys, "import", run, *reversed(plain_sources), "--backend", backend)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"imported 5 steps into {run}: 3 restore points, 2 trajectory points"
    assert out.splitlines()[2] == f"step 30: {plain_sources[2]} (torch), 4 model tensors, 92 B, trajectory point"
    with dh.open(run) as h:
        assert h.steps == [10, 20, 30, 40, 50]
        assert h.restore_points == [10, 20, 50]
        for step, path in zip(h.steps, plain_sources):
            for name, t in model_of(path).items():
                assert_bit_equal(h.read(f"model/{name}", step), t)
        # the optimizer state as a native run names it (parameters by position: a state dict has no names)
        saved = torch.load(plain_sources[1], weights_only=True)["optimizer"]
        for k, state in saved["state"].items():
            for key, t in state.items():
                assert_bit_equal(h.read(f"optim/state/@{k}/{key}", 20), t)
        assert h.scalar("optim/param_groups/0/lr").tolist() == [0.01, 0.01, 0.01]
        assert h.scalar("epoch").tolist() == [1, 2]
        assert h.scalar("source_step").tolist() == [10, 20]  # write() takes the step itself
        x = h.to_xarray("0.weight").values
        assert torch.equal(torch.from_numpy(x[2]), model_of(plain_sources[2])["0.weight"])
        # the trajectory points hold only the model's tensors
        assert h.names(30) == [f"model/{n}" for n in ("0.weight", "0.bias", "1.weight", "1.bias")]
    code, out, err = cli(capsys, "diff", run, 10, 30, "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["model/0.weight"]["max_abs"] == pytest.approx(
        (model_of(plain_sources[0])["0.weight"] - model_of(plain_sources[2])["0.weight"]).abs().max().item())
    code, out, err = cli(capsys, "trace", run, "0.bias", "--json")
    assert code == 0
    assert json.loads(out)["values"] == pytest.approx([model_of(p)["0.bias"].norm().item() for p in plain_sources])


def test_import_transformers_checkpoints(tmp_path, hf_sources, backend, capsys):
    run = tmp_path / "run"
    code, out, err = cli(capsys, "import", run, *hf_sources, "--backend", backend, "--optimizer-type", "AdamW")
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"imported 4 steps into {run}: 2 restore points, 2 trajectory points"
    with dh.open(run) as h:
        assert h.restore_points == [1, 2]
        for step, path in zip(h.steps, hf_sources):
            assert len(model_of(path)) == 28
            for name, t in model_of(path).items():
                assert_bit_equal(h.read(f"model/{name}", step), t)
        optim = torch.load(os.path.join(hf_sources[1], "optimizer.pt"), weights_only=True)
        for k, state in optim["state"].items():
            for key, t in state.items():
                assert_bit_equal(h.read(f"optim/state/@{k}/{key}", 2), t)
        trainer_state = json.load(open(os.path.join(hf_sources[1], "trainer_state.json")))
        assert h.scalar("trainer_state/global_step").tolist() == [1, 2]
        assert h.scalar("scheduler/last_epoch").tolist() == [1, 2]
        assert trainer_state["global_step"] == 2
        # the Trainer's RNG states are the restore point's
        rng = load_torch(os.path.join(hf_sources[1], "rng_state.pth"))
        assert_bit_equal(h.read("rng/torch", 2), rng["cpu"])
        data = h.step_data(2)
        assert data.values["items"]["optim/param_groups"]["type"] == "AdamW"


def test_restore_point_restores_a_model_and_its_rng(tmp_path, plain_sources, capsys):
    run = tmp_path / "run"
    assert cli(capsys, "import", run, *plain_sources[:3])[0] == 0
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    with dh.Checkpointer(run) as ckpt:
        restored = ckpt.restore(20, model=model, rng=False)
        assert restored.step == 20
    for name, t in model.state_dict().items():
        assert torch.equal(t, model_of(plain_sources[1])[name])


def test_step_from_regex_and_order(tmp_path, plain_sources):
    sources = find_sources([plain_sources[2], plain_sources[0]], r"_(\d+)$")
    assert [(os.path.basename(s.path), s.step, s.kind) for s in sources] == [
        ("step_000010.pt", 10, "torch"), ("weights_30.pt", 30, "torch")]


class RunsCommand:
    """Unpickling it runs ``command`` (a pickle that asks for os.system)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    evil = tmp_path / "step_7.pt"
    torch.save({"w": torch.zeros(2), "payload": RunsCommand(f"touch {marker}")}, evil)
    code, out, err = cli(capsys, "import", tmp_path / "run", evil)
    assert (code, out) == (EXIT_USAGE, "")
    assert err == (f"datastates-hist: refused {evil}: it holds more than tensors and plain values, and loading it "
                   "could run code (Trying to load unsupported GLOBAL posix.system whose module posix is blocked)\n")
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_malicious_dcp_metadata_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    folder = tmp_path / "dcp_8"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    code, out, err = cli(capsys, "import", tmp_path / "run", folder)
    assert code == EXIT_USAGE
    assert err == (f"datastates-hist: refused {folder}/.metadata: it holds more than DCP's metadata, and loading "
                   "it could run code (Unsupported global: posix.system)\n")
    assert not marker.exists()
    pickle.loads(pickle.dumps(RunsCommand(f"touch {marker}")))  # the payload does run when unpickled
    assert marker.exists()


def test_bad_sources(tmp_path, plain_sources, capsys):
    run = tmp_path / "run"
    missing = tmp_path / "nope_1.pt"
    assert cli(capsys, "import", run, missing) == (
        EXIT_IO, "", f"datastates-hist: cannot import {missing}: there is no such file or folder\n")
    other = tmp_path / "notes_2.txt"
    other.write_text("x")
    assert cli(capsys, "import", run, other) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {other}: unknown kind of file (a source is a "
        ".pt/.pth/.bin/.ckpt torch.save file, a .safetensors file, a transformers checkpoint folder (checkpoint-N, "
        "save_pretrained) or a PyTorch DCP folder)\n")
    nameless = tmp_path / "final.pt"
    torch.save({"w": torch.zeros(1)}, nameless)
    assert cli(capsys, "import", run, nameless) == (
        EXIT_USAGE, "", f"datastates-hist: cannot tell the step of {nameless}: no step number in its name 'final' "
        "(give one with --step-from REGEX, e.g. 'step_(\\d+)')\n")
    twin = tmp_path / "copy_10.pt"
    twin.write_bytes(open(plain_sources[0], "rb").read())
    assert cli(capsys, "import", run, plain_sources[0], twin) == (
        EXIT_USAGE, "", f"datastates-hist: {plain_sources[0]} and {twin} are both step 10: leave one out, or tell "
        "their steps apart with --step-from REGEX\n")
    assert cli(capsys, "import", run, plain_sources[0], "--step-from", "(a)(b)")[2] == (
        "datastates-hist: --step-from '(a)(b)' needs exactly one group, the step's digits, such as 'step_(\\d+)'\n")
    truncated = tmp_path / "cut_3.pt"
    truncated.write_bytes(open(plain_sources[2], "rb").read()[:100])
    assert cli(capsys, "import", run, truncated) == (
        EXIT_IO, "", f"datastates-hist: cannot read {truncated}: PytorchStreamReader failed reading zip archive: "
        "failed finding central directory\n")
    assert not run.exists()


def test_run_that_has_the_steps_is_refused(tmp_path, plain_sources, capsys):
    run = tmp_path / "run"
    assert cli(capsys, "import", run, *plain_sources[:2])[0] == 0
    assert cli(capsys, "import", run, plain_sources[1]) == (
        EXIT_USAGE, "", f"datastates-hist: {run} already holds step 20 ({plain_sources[1]}); nothing was imported: "
        "import into a new run, or leave out the sources it holds\n")
    code, out, err = cli(capsys, "import", run, plain_sources[2])  # later steps append
    assert code == 0 and out.splitlines()[-1] == f"imported 1 step into {run}: 0 restore points, 1 trajectory point"
    with dh.open(run) as h:
        assert h.steps == [10, 20, 30]


def test_source_without_optimizer_keeps_every_tensor(tmp_path, backend, capsys):
    """A Lightning .ckpt: its optimizer_states list, EMA weights and epoch are extras, kept
    in the step's main unit when it becomes a trajectory point."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    source = tmp_path / "epoch=3-step=40.ckpt"
    saved = {"state_dict": model.state_dict(), "ema": {k: v * 2 for k, v in model.state_dict().items()},
             "optimizer_states": [opt.state_dict()], "epoch": 3}
    torch.save(saved, source)
    run = tmp_path / "run"
    code, out, err = cli(capsys, "import", run, source, "--step-from", r"step=(\d+)", "--backend", backend)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"imported 1 step into {run}: 0 restore points, 1 trajectory point"
    expected = {**{f"model/{k}": v for k, v in saved["state_dict"].items()},
                **{f"extra/ema/{k}": v for k, v in saved["ema"].items()},
                **{f"extra/optimizer_states/0/state/{p}/{k}": v
                   for p, state in saved["optimizer_states"][0]["state"].items() for k, v in state.items()}}
    with dh.open(run) as h:
        assert h.restore_points == []
        assert sorted(h.names(40)) == sorted(expected)
        for name, t in expected.items():
            assert_bit_equal(h.read(name, 40), t)
        assert h.scalar("epoch").tolist() == [3]
    assert cli(capsys, "verify", run)[0] == 0


def test_sources_a_backend_cannot_store_leave_no_run(tmp_path, capsys):
    w = torch.ones(2)
    cases = {
        "set_1.pt": ({"model": {"w": w}, "s": {1, 2}}, "cannot checkpoint 'extra/s': value: a value of type "
                     "builtins.set cannot be stored without pickle; convert it to numbers, strings, lists and dicts, "
                     "give it state_dict()/load_state_dict(), or register a StateProvider for its type"),
        "sparse_2.pt": ({"model": {"w": w.to_sparse()}},
                        "tensor 'model/w' has layout torch.sparse_coo; only dense tensors can be checkpointed"),
        "nested_3.pt": ({"model": {"w": w}, "optimizer": {"state": {0: {"buf": {"a": w}}},
                                                         "param_groups": [{"params": [0], "lr": 0.1}]}},
                        "cannot checkpoint 'optim': state/@0/buf.a: a value of type torch.Tensor cannot be stored "
                        "without pickle; convert it to numbers, strings, lists and dicts, give it "
                        "state_dict()/load_state_dict(), or register a StateProvider for its type"),
        "empty_4.pt": ({"model": {"w": w, "": w}}, "tensor 'model' is also the group of tensor 'model/w': a name "
                       "cannot be both a tensor and the prefix of another; rename one"),
    }
    for name, (obj, why) in cases.items():
        source, run = tmp_path / name, tmp_path / f"run_{name}"
        torch.save(obj, source)
        assert cli(capsys, "import", run, source) == (EXIT_USAGE, "", f"datastates-hist: cannot import {source}: "
                                                      f"{why}\n")
        assert not run.exists()


def test_colliding_names_are_refused(tmp_path, capsys):
    w = torch.ones(2)
    keys, nested = tmp_path / "keys_1.pt", tmp_path / "nested_2.pt"
    torch.save({"model": {"w": w}, 1: "int", "1": "str"}, keys)
    torch.save({"model": {"x": {"y": w}, "x.y": torch.zeros(2)}}, nested)
    assert cli(capsys, "import", tmp_path / "run", keys) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {keys}: its keys 1 and '1' would both be named '1'\n")
    renamed = tmp_path / "renamed_3.pt"
    torch.save({"model": {"w": w}, "step": 3, "source_step": 3}, renamed)
    assert cli(capsys, "import", tmp_path / "run", renamed) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {renamed}: its entries 'step' and 'source_step' would both "
        "be stored as 'source_step'\n")
    assert cli(capsys, "import", tmp_path / "run", nested) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {nested} ['model']: two of its tensors are named 'x.y' "
        "(one nested)\n")
    from safetensors.torch import save_file

    shards = tmp_path / "checkpoint-3"
    shards.mkdir()
    save_file({"a": w, "b": torch.ones(3)}, shards / "one.safetensors")
    save_file({"b": torch.zeros(2)}, shards / "two.safetensors")
    (shards / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
    assert cli(capsys, "import", tmp_path / "run", shards) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {shards}: tensor 'b' is in two.safetensors and an earlier "
        "shard; which one is the model's?\n")
    assert not (tmp_path / "run").exists()


def test_damaged_torch_file_is_not_called_malicious(tmp_path, capsys):
    noise = tmp_path / "step_3.pt"
    noise.write_bytes(bytes(range(256)) * 2)
    assert cli(capsys, "import", tmp_path / "run", noise) == (
        EXIT_IO, "", f"datastates-hist: cannot read {noise}: damaged or not a torch file\n")
    import numpy as np

    objects = tmp_path / "step_4.pt"  # a numpy array of objects: unpickling it builds any object
    torch.save({"w": torch.zeros(1), "rng": np.array([None, "x"], dtype=object)}, objects)
    assert cli(capsys, "import", tmp_path / "run", objects) == (
        EXIT_USAGE, "", f"datastates-hist: refused {objects}: it holds more than tensors and plain values, and "
        "loading it could run code (Can only build Tensor, Parameter, OrderedDict or types allowlisted via "
        "`add_safe_globals`, but got <class 'numpy.dtypes.ObjectDType'>)\n")


def test_default_step_pattern_takes_ascii_digits_only(tmp_path, capsys):
    source = tmp_path / "uni_\u0661\u0662.pt"
    torch.save({"w": torch.zeros(1)}, source)
    assert cli(capsys, "import", tmp_path / "run", source) == (
        EXIT_USAGE, "", f"datastates-hist: cannot tell the step of {source}: no step number in its name "
        "'uni_\u0661\u0662' (give one with --step-from REGEX, e.g. 'step_(\\d+)')\n")
    assert cli(capsys, "import", tmp_path / "run", source, "--step-from", "x([0-9]+)") == (
        EXIT_USAGE, "", f"datastates-hist: cannot tell the step of {source}: --step-from 'x([0-9]+)' finds no step "
        "in its name 'uni_\u0661\u0662'\n")


# --- crafted DCP folders -----------------------------------------------------------------

def dcp_folder(path, state):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def edit_metadata(folder, edit):
    """Rewrite a DCP folder's .metadata after ``edit(metadata)`` (a crafted folder)."""
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def set_storage(**fields):
    def edit(metadata):
        for info in metadata.storage_data.values():
            for key, value in fields.items():
                setattr(info, key, value)
    return edit


def test_dcp_storage_outside_the_folder_is_refused(tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"0123456789abcdef")
    (tmp_path / "inside_9").mkdir()
    cases = {
        "../secret.txt": "names '../secret.txt', outside the folder",
        str(secret): f"names {str(secret)!r}, not a file of the folder",
        "inside": "names 'inside', outside the folder",
        "missing.distcp": "names 'missing.distcp', which is not a file of the folder",
    }
    for step, (path, why) in enumerate(cases.items()):
        folder = dcp_folder(tmp_path / f"dcp_{step}", {"model": {"w": torch.zeros(16, dtype=torch.uint8)}})
        edit_metadata(folder, set_storage(relative_path=path, offset=0, length=16))
        if path == "inside":
            os.symlink(tmp_path / "inside_9", folder / "inside")
        assert cli(capsys, "import", tmp_path / "run", folder) == (
            EXIT_USAGE, "", f"datastates-hist: cannot import {folder}: the storage entry of 'model.w' {why}\n")
    folder = dcp_folder(tmp_path / "dcp_8", {"model": {"w": torch.zeros(16, dtype=torch.uint8)}})
    size = os.path.getsize(folder / "__0_0.distcp")
    edit_metadata(folder, set_storage(offset=8, length=size))
    assert cli(capsys, "import", tmp_path / "run", folder) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {folder}: the storage entry of 'model.w' reads bytes "
        f"8+{size} of '__0_0.distcp', which holds {size}\n")
    assert not (tmp_path / "run").exists()


def test_dcp_malicious_byte_item_and_damaged_data(tmp_path, capsys):
    marker = tmp_path / "ran"
    folder = dcp_folder(tmp_path / "dcp_7", {"model": {"w": torch.ones(4)}, "extra": {"note": [1, 2]}})
    torch.save(RunsCommand(f"touch {marker}"), folder / "evil.distcp")

    def plant(metadata):
        for index, info in metadata.storage_data.items():
            if index.fqn == "extra.note":
                info.relative_path, info.offset = "evil.distcp", 0
                info.length = os.path.getsize(folder / "evil.distcp")
    edit_metadata(folder, plant)
    assert cli(capsys, "import", tmp_path / "run", folder) == (
        EXIT_USAGE, "", f"datastates-hist: refused {folder}: a non-tensor item holds more than plain values, and "
        "loading it could run code (Trying to load unsupported GLOBAL posix.system whose module posix is blocked)\n")
    assert not marker.exists()
    damaged = dcp_folder(tmp_path / "dcp_8", {"model": {"w": torch.ones(4)}})
    data = damaged / "__0_0.distcp"
    data.write_bytes(bytes(os.path.getsize(data)))  # the size it had, zeros
    assert cli(capsys, "import", tmp_path / "run", damaged) == (
        EXIT_IO, "", f"datastates-hist: cannot read {damaged}: an item's data is damaged or not a torch file\n")
    other = dcp_folder(tmp_path / "dcp_10", {"model": {"w": torch.ones(4)}})
    torch.save(torch.ones(3), other / "__0_0.distcp")  # a tensor of another size
    edit_metadata(other, set_storage(length=os.path.getsize(other / "__0_0.distcp")))
    assert cli(capsys, "import", tmp_path / "run", other) == (
        EXIT_IO, "", f"datastates-hist: cannot read {other}: AssertionError: req MetadataIndex(fqn='model.w', "
        "offset=torch.Size([0]), index=0) mismatch sizes torch.Size([4]) vs torch.Size([3])\n")
    truncated = dcp_folder(tmp_path / "dcp_9", {"model": {"w": torch.ones(4)}})
    data = truncated / "__0_0.distcp"
    size = os.path.getsize(data)
    data.write_bytes(data.read_bytes()[:100])
    assert cli(capsys, "import", tmp_path / "run", truncated) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {truncated}: the storage entry of 'model.w' reads bytes "
        f"0+{size} of '__0_0.distcp', which holds 100\n")
    assert not (tmp_path / "run").exists()


def test_dcp_crafted_paths_and_sizes_are_refused(tmp_path, capsys):
    def planner_path(path):
        def edit(metadata):
            metadata.planner_data["model.w"] = path
        return edit

    def huge(metadata):
        metadata.state_dict_metadata["model.w"].size = torch.Size([10**6, 10**6])

    cases = [
        (planner_path(("model", -5)), "its metadata gives 'model.w' the path ('model', -5) (a path is keys, or "
                                      "list positions below 1)"),
        (planner_path(()), "its metadata gives 'model.w' the path () (a path is keys, or list positions below 1)"),
        (planner_path(("model", "w", 10**6)), "its metadata gives 'model.w' the path ('model', 'w', 1000000) (a path "
                                              "is keys, or list positions below 1)"),
        (huge, "its metadata gives 'model.w' 4000000000000 bytes, more than the 1577 its files hold"),
    ]
    for step, (edit, why) in enumerate(cases):
        folder = dcp_folder(tmp_path / f"dcp_{step}", {"model": {"w": torch.ones(4)}})
        edit_metadata(folder, edit)
        assert cli(capsys, "import", tmp_path / "run", folder) == (
            EXIT_USAGE, "", f"datastates-hist: cannot import {folder}: {why}\n")
    noise = tmp_path / "dcp_9"
    noise.mkdir()
    (noise / ".metadata").write_bytes(b"\x80\x04garbage")
    code, out, err = cli(capsys, "import", tmp_path / "run", noise)
    assert (code, out) == (EXIT_IO, "")
    assert err.startswith(f"datastates-hist: cannot read {noise}/.metadata: damaged or not DCP metadata (")


def test_rng_states_without_optimizer_stay_a_restore_point(tmp_path, capsys):
    from safetensors.torch import save_file

    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    save_file({"w": torch.arange(4.0)}, folder / "model.safetensors")
    torch.manual_seed(5)
    rng = {"cpu": torch.get_rng_state()}
    torch.save(rng, folder / "rng_state.pth")
    run = tmp_path / "run"
    code, out, err = cli(capsys, "import", run, folder)
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"imported 1 step into {run}: 1 restore point, 0 trajectory points"
    with dh.open(run) as h:
        assert h.restore_points == [5]
        assert_bit_equal(h.read("rng/torch", 5), rng["cpu"])
