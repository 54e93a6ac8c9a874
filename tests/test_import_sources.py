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
from datastates_hist.cli import EXIT_IO, EXIT_MISSING, EXIT_USAGE, main
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


def test_restore_point_restores_a_model_and_no_rng_of_the_importing_process(tmp_path, plain_sources, capsys):
    run = tmp_path / "run"
    assert cli(capsys, "import", run, *plain_sources[:3])[0] == 0
    with dh.open(run) as h:  # the source holds no RNG states: none stored, none made up
        assert 20 in h.restore_points and not [r for r in h.store.records(20) if r.name.startswith("rng/")]
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = torch.get_rng_state()
    with dh.Checkpointer(run) as ckpt:
        restored = ckpt.restore(20, model=model)
        assert restored.step == 20 and restored.rng is False
    assert torch.equal(torch.get_rng_state(), before)
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
        EXIT_MISSING, "", f"datastates-hist: cannot import {missing}: there is no such file or folder\n")
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
        "nested_3.pt": ({"model": {"w": w}, "optimizer": {"state": {0: {"buf": {"a": {1, 2}}}},
                                                         "param_groups": [{"params": [0], "lr": 0.1}]}},
                        "cannot checkpoint 'optim': optimizer state 'buf' of parameter '@0'/a: a value of type "
                        "builtins.set cannot be stored without pickle; convert it to numbers, strings, lists and "
                        "dicts, give it state_dict()/load_state_dict(), or register a StateProvider for its type"),
        "empty_4.pt": ({"model": {"w": w, "": w}}, "one of its model tensors has an empty name (''), which the "
                       "backends cannot store"),
        "empty_5.pt": ({"": w}, "one of its model tensors has an empty name (''), which the backends cannot store"),
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

    def huge(metadata):  # one chunk, all of it, in an entry of a few bytes
        metadata.state_dict_metadata["model.w"].size = torch.Size([10**12])
        metadata.state_dict_metadata["model.w"].chunks[0].sizes = torch.Size([10**12])

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


def test_torch_file_whose_record_is_shorter_than_its_storage_is_refused(tmp_path, capsys):
    """A memory-mapped torch.load takes a storage's bytes from its record on without
    checking the record's size: a short record would lend bytes of the next zip header."""
    import zipfile

    good, short = tmp_path / "good.pt", tmp_path / "step_1.pt"
    torch.save({"w": torch.full((4,), 7.0)}, good)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(short, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info.filename, data[:8] if info.filename.endswith("/data/0") else data)
    with pytest.raises(RuntimeError, match="record size"):  # what a plain torch.load says
        torch.load(short, weights_only=True)
    assert cli(capsys, "import", tmp_path / "run", short) == (
        EXIT_IO, "", f"datastates-hist: cannot read {short}: its tensors' storages do not match the records holding "
        "their bytes (a record shorter or longer than its storage): damaged\n")
    assert not (tmp_path / "run").exists()
    shared = tmp_path / "shared_2.pt"  # two tensors of one storage, and an empty one: still one record each
    base = torch.arange(8.0)
    torch.save({"a": base[:4], "b": base[4:], "c": torch.ones(3), "e": torch.empty(0)}, shared)
    assert torch.equal(load_torch(str(shared))["b"], base[4:])


def test_dcp_chunks_that_do_not_tile_a_tensor_are_refused(tmp_path, capsys):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def chunks(*boxes):
        def edit(metadata):
            metadata.state_dict_metadata["model.w"].chunks = [
                ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in boxes]
        return edit

    cases = [
        (chunks(), "chunks that do not tile it (0 of its 6 elements covered, or some twice): the rest would be "
                   "uninitialised memory"),
        (chunks(((0, 0), (1, 3)), ((0, 0), (1, 3))), "chunks that do not tile it (some of its elements covered "
                                                     "twice, others by none): the rest would be uninitialised memory"),
        (chunks(((1, 0), (2, 3))), "(size (2, 3)) a chunk at (1, 0) of size (2, 3), not inside it"),
        (chunks(((0, 0), (1, 3)), ((1, 0), (1, 3))), "a chunk at (1, 0) that no storage entry holds"),
    ]
    for step, (edit, why) in enumerate(cases):
        folder = dcp_folder(tmp_path / f"dcp_{step}", {"model": {"w": torch.ones(2, 3)}})
        edit_metadata(folder, edit)
        assert cli(capsys, "import", tmp_path / "run", folder) == (
            EXIT_USAGE, "", f"datastates-hist: cannot import {folder}: its metadata gives 'model.w' {why}\n")
    assert not (tmp_path / "run").exists()

    def two_rows(metadata):  # model.w as two sharded rows: the chunks model.a and model.b were saved as
        from torch.distributed.checkpoint.metadata import MetadataIndex

        a, b = (metadata.state_dict_metadata.pop(f"model.{n}") for n in "ab")
        metadata.state_dict_metadata["model.w"] = a
        a.size, b.chunks[0].offsets = torch.Size([2, 3]), torch.Size([1, 0])
        a.chunks.append(b.chunks[0])
        entries = metadata.storage_data
        entries[MetadataIndex("model.w", (0, 0))] = entries[MetadataIndex("model.a", (0, 0))]
        entries[MetadataIndex("model.w", (1, 0))] = entries[MetadataIndex("model.b", (0, 0))]
        metadata.planner_data = {"model.w": ("model", "w")}

    sharded = dcp_folder(tmp_path / "dcp_9", {"model": {"a": torch.ones(1, 3), "b": torch.full((1, 3), 2.0)}})
    edit_metadata(sharded, two_rows)
    assert cli(capsys, "import", tmp_path / "run", sharded)[0] == 0
    with dh.open(tmp_path / "run") as h:
        assert torch.equal(h.read("model/w", 9), torch.tensor([[1.0, 1, 1], [2, 2, 2]]))


def test_dcp_size_checks_hold_beside_a_transform_no_chunk_reads(tmp_path, capsys):
    """An entry that claims a transform (compression), read by no chunk, leaves every
    size check on: each chunk within its entry, the tensors within the folder's files."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata)

    def ghosts(numel, count=1):
        def edit(metadata):
            w = metadata.storage_data[MetadataIndex("model.w", (0,))]
            metadata.storage_data[MetadataIndex("orphan")] = _StorageInfo(w.relative_path, 0, 1, ["stream.zstd/1"])
            for n in range(count):  # tensors whose one chunk reads model.w's bytes
                fqn = f"model.ghost{n}"
                metadata.state_dict_metadata[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=torch.float32), torch.Size([numel]),
                    [ChunkStorageMetadata(torch.Size([0]), torch.Size([numel]))])
                metadata.storage_data[MetadataIndex(fqn, (0,))] = w
                metadata.planner_data[fqn] = ("model", f"ghost{n}")
        return edit

    state = {"model": {"w": torch.ones(4), "big": torch.ones(1000)}}
    folder = dcp_folder(tmp_path / "dcp_0", state)
    stored = os.path.getsize(folder / "__0_0.distcp")
    with open(folder / ".metadata", "rb") as f:
        entry = next(info.length for index, info in pickle.load(f).storage_data.items() if index.fqn == "model.w")
    cases = [
        (ghosts(2**28), f"its metadata gives 'model.ghost0' {2**30} bytes, more than the {stored} its files hold"),
        (ghosts(600), f"its metadata gives a chunk of 'model.ghost0' 2400 bytes, more than the {entry} of its "
                      "storage entry"),
        (ghosts(300, count=10), f"its metadata gives its tensors {4016 + 3 * 1200} bytes or more, more than the "
                                f"{stored} its files hold"),
    ]
    for step, (edit, why) in enumerate(cases, start=1):
        folder = dcp_folder(tmp_path / f"dcp_{step}", state)
        edit_metadata(folder, edit)
        assert cli(capsys, "import", tmp_path / "run", folder) == (
            EXIT_USAGE, "", f"datastates-hist: cannot import {folder}: {why}\n")
    assert not (tmp_path / "run").exists()


def test_sources_that_are_not_regular_files_inside_are_refused(tmp_path, capsys):
    """A FIFO would block the import forever; a link out of a folder is not the folder's."""
    from safetensors.torch import save_file

    fifo_pt, fifo_st = tmp_path / "step_1.pt", tmp_path / "step_2.safetensors"
    os.mkfifo(fifo_pt)
    os.mkfifo(fifo_st)
    for fifo in (fifo_pt, fifo_st):
        assert cli(capsys, "import", tmp_path / "run", fifo) == (
            EXIT_USAGE, "", f"datastates-hist: cannot import {fifo}: not a regular file\n")
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    folder = dcp_folder(tmp_path / "dcp_3", {"model": {"w": torch.ones(4)}})
    os.replace(folder / ".metadata", outside)
    os.symlink(outside, folder / ".metadata")
    assert cli(capsys, "import", tmp_path / "run", folder) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {folder}: .metadata links outside the folder\n")
    os.remove(folder / ".metadata")
    os.mkfifo(folder / ".metadata")
    assert cli(capsys, "import", tmp_path / "run", folder) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {folder}/.metadata: not a regular file\n")
    trainer = tmp_path / "checkpoint-4"
    trainer.mkdir()
    save_file({"w": torch.ones(2)}, trainer / "model.safetensors")
    os.mkfifo(trainer / "rng_state.pth")
    assert cli(capsys, "import", tmp_path / "run", trainer) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {trainer}/rng_state.pth: not a regular file\n")
    assert not (tmp_path / "run").exists()


def test_a_transformers_folder_of_links_like_the_hub_cache_imports(tmp_path, capsys):
    """A Hugging Face hub cache snapshot is a folder of links into the cache's blobs/:
    a transformers folder's files may link out of it, to regular files."""
    from safetensors.torch import save_file

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    save_file({"w": torch.arange(4.0)}, blobs / "9f2c")
    os.symlink(os.path.relpath(blobs / "9f2c", snapshot), snapshot / "model.safetensors")
    (blobs / "c0de").write_text('{"model_type": "gpt2"}')
    os.symlink(blobs / "c0de", snapshot / "config.json")
    code, out, err = cli(capsys, "import", tmp_path / "run", snapshot, "--step-from", r"(\d+)abc")
    assert (code, err) == (0, ""), err
    with dh.open(str(tmp_path / "run")) as h:
        assert h.steps == [123] and torch.equal(h.read("w", 123), torch.arange(4.0))


def test_malformed_optimizer_and_rng_states_are_refused(tmp_path, capsys):
    import numpy as np
    from safetensors.torch import save_file

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    good = opt.state_dict()
    wrong = "expected an optimizer state dict, but its"
    optimizers = {
        "step_1.pt": ({"state": good["state"], "param_groups": [{"lr": 0.1}]},
                      f"{wrong} param_groups[0] is a dict with keys 'lr', not a dict with a 'params' list"),
        "step_2.pt": ({"state": {0: "momentum"}, "param_groups": good["param_groups"]},
                      f"{wrong} state[0] is a str, not a dict of one parameter's state"),
        "step_3.pt": ({"state": good["state"], "param_groups": ["lr=0.1"]},
                      f"{wrong} param_groups[0] is a str, not a dict with a 'params' list"),
        "step_4.pt": ({"state": {}, "param_groups": [{"params": [0, 1.5]}]},
                      f"{wrong} param_groups[0]['params'] holds 1.5, not a parameter's index or name"),
        "step_9.pt": ({"state": {}, "param_groups": [{"params": [0]}, {"params": [1, 0]}]},
                      f"{wrong} param_groups list the parameter 0 twice"),
    }
    for name, (optim, why) in optimizers.items():
        source = tmp_path / name
        torch.save({"model": model.state_dict(), "optimizer": optim}, source)
        assert cli(capsys, "import", tmp_path / "run", source) == (
            EXIT_USAGE, "", f"datastates-hist: cannot import {source} ['optimizer']: {why}\n")
    rngs = {
        5: ({"cpu": torch.zeros(3, dtype=torch.uint8)}, "its 'cpu' entry is not a torch CPU RNG state (Expected a "
            "CPUGeneratorImplState of size 5056 but found the input RNG state size to be 3)"),
        6: ({"python": (3, (1, 2), None)}, "its 'python' entry is not a Python random RNG state (state vector is "
            "the wrong size)"),
        7: ({"numpy": ("MT19937", np.zeros(3, dtype=np.uint32), 0, 0, 0.0)}, "its 'numpy' entry is not a numpy RNG "
            "state (index 3 is out of bounds for axis 0 with size 3)"),
        8: ("cpu", "expected a Trainer's RNG states (a dict: cpu, numpy, python, ...), found a str"),
    }
    for n, (rng, why) in rngs.items():
        folder = tmp_path / f"checkpoint-{n}"
        folder.mkdir()
        save_file({"w": torch.ones(2)}, folder / "model.safetensors")
        torch.save(rng, folder / "rng_state.pth")
        assert cli(capsys, "import", tmp_path / "run", folder) == (
            EXIT_USAGE, "", f"datastates-hist: cannot import {folder}/rng_state.pth: {why}\n")
    assert not (tmp_path / "run").exists()


def test_model_dicts_nested_too_deep_are_refused(tmp_path, capsys):
    import sys

    nested = torch.ones(1)
    for _ in range(3000):  # deeper than Python recurses
        nested = {"k": nested}
    source = tmp_path / "step_1.pt"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # for torch.save's pickler
    try:
        torch.save({"model": nested}, source)
    finally:
        sys.setrecursionlimit(limit)
    assert cli(capsys, "import", tmp_path / "run", source) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {source} ['model']: its dicts are nested more than 100 "
        "levels deep\n")


def test_plain_numpy_arrays_import_and_object_arrays_do_not(tmp_path, capsys):
    import numpy as np

    dtypes = [np.bool_, np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
              np.uint16, np.uint32, np.uint64]
    source = tmp_path / "step_1.pt"
    arrays = {f"a_{np.dtype(t).name}": np.arange(3).astype(t) for t in dtypes}
    torch.save({"model": {"w": torch.ones(2)}, **arrays}, source)
    assert cli(capsys, "import", tmp_path / "run", source)[0] == 0
    with dh.open(tmp_path / "run") as h:
        for name, array in arrays.items():
            assert torch.equal(h.read(f"extra/{name}", 1), torch.from_numpy(array))
    objects = tmp_path / "step_2.pt"
    torch.save({"model": {"w": torch.ones(2)}, "a": np.array([1, "x"], dtype=object)}, objects)
    assert cli(capsys, "import", tmp_path / "run", objects)[0] == EXIT_USAGE


def test_values_and_tensors_that_expand_far_beyond_their_file_are_refused(tmp_path, capsys):
    """A "billion laughs" (x = [x, x], pickle's memo sharing it) and a view that expands
    one element to 4 MiB: the import would walk and store far more than the file holds."""
    laughs = [0]
    for _ in range(14):
        laughs = [laughs, laughs]
    source = tmp_path / "step_1.pt"
    torch.save({"model": {"w": torch.ones(2)}, "laughs": laughs}, source)
    size = os.path.getsize(source)
    assert cli(capsys, "import", tmp_path / "run", source) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {source}: its lists and dicts, shared many times over, would "
        f"expand to {3 * 2**14 + 2} entries from {size} bytes (more than {16 * size}): refused\n")
    expanded = tmp_path / "step_2.pt"
    torch.save({"w": torch.zeros(1).expand(2**20)}, expanded)
    size = os.path.getsize(expanded)
    assert cli(capsys, "import", tmp_path / "run", expanded) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import {expanded}: its tensors would take {4 * 2**20} bytes from "
        f"{size} bytes of file (more than {16 * size}: views that expand or repeat one storage): refused; save "
        "copies of them (.clone()) to import them\n")
    assert not (tmp_path / "run").exists()
    shared = tmp_path / "step_3.pt"  # what real checkpoints share: a tied weight, a list held twice
    w, hparams = torch.randn(64, 64), [1, 2, 3]
    torch.save({"model": {"embed": w, "head": w}, "a": hparams, "b": hparams}, shared)
    assert cli(capsys, "import", tmp_path / "run", shared)[0] == 0
    with dh.open(tmp_path / "run") as h:
        assert torch.equal(h.read("model/head", 3), w)


def test_run_inside_a_source_and_failed_import_into_an_empty_folder(tmp_path, capsys):
    folder = dcp_folder(tmp_path / "dcp_1", {"model": {"w": torch.ones(4)}})
    before = sorted(os.listdir(folder))
    assert cli(capsys, "import", folder, folder) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import into {folder}: it is the source {folder}, which the import "
        "would write into; import into a new run\n")
    assert cli(capsys, "import", folder / "run", folder) == (
        EXIT_USAGE, "", f"datastates-hist: cannot import into {folder}/run: it is inside the source {folder}, which "
        "the import would write into; import into a new run\n")
    assert sorted(os.listdir(folder)) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = tmp_path / "step_2.pt"
    torch.save({"model": {"w": torch.ones(2)}, "s": {1, 2}}, bad)  # a set: no backend stores it
    assert cli(capsys, "import", empty, bad)[0] == EXIT_USAGE
    assert empty.is_dir() and os.listdir(empty) == []


def test_a_step_is_reported_once_committed(tmp_path, capsys):
    """The steps before a source that fails are committed, and reported; the failing one is not."""
    sources = [tmp_path / f"step_{n}.pt" for n in (1, 2, 3)]
    for n, source in enumerate(sources, start=1):
        torch.save({"model": {"w": torch.full((2,), float(n))}, **({"s": {1}} if n == 3 else {})}, source)
    run = tmp_path / "run"
    code, out, err = cli(capsys, "import", run, *sources)
    assert (code, out.splitlines()) == (EXIT_USAGE, [
        f"step {n}: {sources[n - 1]} (torch), 1 model tensors, 8 B, trajectory point" for n in (1, 2)])
    assert err.startswith(f"datastates-hist: cannot import {sources[2]}: cannot checkpoint 'extra/s'")
    with dh.open(run) as h:
        assert h.steps == [1, 2] and h.restore_points == []


def test_dcp_metadata_cannot_set_attributes_of_a_class(tmp_path, capsys):
    """A BUILD on a class the unpickler hands out (pathlib.PosixPath) would change it for the
    whole process: refused, and the class is as it was."""
    import pathlib

    folder = dcp_folder(tmp_path / "dcp_1", {"model": {"w": torch.ones(4)}})
    body = (folder / ".metadata").read_bytes()
    body = pickle.dumps(pickle.loads(body), protocol=2)
    # GLOBAL pathlib.PosixPath; (None, {'read_text': None}) BUILD; POP  -- then the real metadata
    poison = b"cpathlib\nPosixPath\nN}X\x09\x00\x00\x00read_textNs\x86b0"
    (folder / ".metadata").write_bytes(body[:2] + poison + body[2:])
    assert cli(capsys, "import", tmp_path / "run", folder) == (
        EXIT_USAGE, "", f"datastates-hist: refused {folder}/.metadata: it holds more than DCP's metadata, and loading "
        "it could run code (Unsupported BUILD: setting the attributes of <class 'pathlib.PosixPath'>)\n")
    assert pathlib.PosixPath.read_text is pathlib.Path.read_text and callable(pathlib.PosixPath.read_text)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("codec", ["raw", "delta"])
def test_large_tensors_are_written_from_their_own_memory_bit_exact(tmp_path, backend, codec, capsys):
    """Tensors read from a source are written from their own memory in pieces, not copied into
    the host cache: bit-exact (float32 split by rows, a bfloat16 tensor split inside a row, deltas
    against the step before), their checksums verified, the cache holding only the small ones and
    a transposed tensor, which is copied as a training run's are. A write waits until the step
    before it is committed: no cache bounds what is in flight."""
    from datastates_hist import Checkpointer
    from datastates_hist.importing import ModelState, OptimizerState

    torch.manual_seed(0)
    run = tmp_path / "run"
    ckpt = Checkpointer(run, backend=backend, codec=codec, piece_bytes=64 << 10, host_cache_bytes=1 << 20)
    states = []
    for step in (1, 2):
        model = {"w": torch.randn(96, 1000), "b": torch.randn(5), "t": torch.randn(300, 96).t(),
                 "e": torch.randn(2, 40, 1000).to(torch.bfloat16), "empty": torch.zeros(0, 7)}
        optimizer = {"state": {0: {"exp_avg": torch.randn(96, 1000), "step": torch.tensor(float(step))}},
                     "param_groups": [{"params": [0], "lr": 0.1}]}
        ckpt.write(step, ModelState(model), OptimizerState(optimizer, "AdamW"))
        states.append((model, optimizer))
        # no cache bounds the tensors in flight: a write waits until the previous step's are written
        assert set(range(1, step)) <= set(ckpt.steps())  # this step's may be committed too
    ckpt.wait()
    large = sum(t.numel() * t.element_size() for t in (*states[0][0].values(), states[0][1]["state"][0]["exp_avg"]))
    transposed = 2 * states[0][0]["t"].numel() * 4
    assert transposed <= ckpt.cache.allocated < transposed + large // 10
    ckpt.close()
    with dh.open(run) as h:
        assert h.steps == [1, 2]
        for step, (model, optimizer) in zip((1, 2), states):
            for name, t in model.items():
                assert_bit_equal(h.read(f"model/{name}", step), t)
            assert_bit_equal(h.read("optim/state/@0/exp_avg", step), optimizer["state"][0]["exp_avg"])
        encodings = h.tensors(2).set_index("name")["encoding"]
        assert encodings["model/w"] == ("raw" if codec == "raw" else "delta")
    code, out, err = cli(capsys, "verify", run)
    assert (code, err) == (0, "")


def test_entries_named_as_restores_options_are_kept_as_source_entries(tmp_path, capsys):
    """A checkpoint's own "rng" state (or "strict") cannot be an extra of that name:
    restore() takes rng= and strict= itself. It is kept as source_rng."""
    from datastates_hist.cli import main

    source = tmp_path / "ckpt_100.pt"
    rng = torch.get_rng_state()
    torch.save({"model": {"w": torch.ones(2)}, "rng": rng, "strict": True, "epoch": 3}, source)
    run = str(tmp_path / "run")
    assert main(["import", run, str(source)]) == 0, capsys.readouterr().err
    with dh.open(run) as h:
        assert h.steps == [100]
        assert_bit_equal(h.read("extra/source_rng", 100), rng)
        assert h.scalar("source_strict").tolist() == [1] and h.scalar("epoch").tolist() == [3]
