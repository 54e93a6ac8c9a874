"""``datastates-hist export --to DIR.dcp``: a step as a PyTorch DCP checkpoint that
``torch.distributed.checkpoint.load`` takes into a fresh model, bit-exact."""

import os
import shutil
import warnings

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli import EXIT_USAGE, main


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def dcp_load(state_dict, folder):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # no process group: one process, as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state_dict, checkpoint_id=str(folder), no_dist=True)


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


@pytest.fixture
def trained(tmp_path, backend):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = tmp_path / "run"
    with dh.Checkpointer(run, backend=backend) as ckpt:
        for step in range(3):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            ckpt.write(step, model, opt)
        ckpt.wait()
    return run, model, opt


def test_export_dcp_loads_into_a_fresh_model(tmp_path, trained, capsys):
    run, model, _ = trained
    target = tmp_path / "step2.dcp"
    assert cli(capsys, "export", run, 2, "--to", target) == (0, f"wrote 9 tensors of step 2 to {target}\n", "")
    fresh = make_model()
    state = fresh.state_dict()
    dcp_load(state, target)
    fresh.load_state_dict(state)
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    assert not os.path.exists(f"{target}.partial")


def test_export_dcp_all_tensors(tmp_path, trained, capsys):
    run, model, opt = trained
    target = tmp_path / "everything"
    code, out, err = cli(capsys, "export", run, "latest", "--to", target, "--format", "dcp", "--all")
    assert (code, err) == (0, "")
    with dh.open(run) as h:
        names = h.names(2)
        state = {n: torch.empty_like(h.read(n, 2)) for n in names}
        dcp_load(state, target)
        for name in names:
            assert torch.equal(state[name], h.read(name, 2)), name
    assert torch.equal(state["optim/state/0.weight/momentum_buffer"], opt.state[model[0].weight]["momentum_buffer"])


def test_existing_target_needs_force(tmp_path, trained, capsys):
    run, model, _ = trained
    target = tmp_path / "step.dcp"
    assert cli(capsys, "export", run, 0, "--to", target)[0] == 0
    assert cli(capsys, "export", run, 2, "--to", target) == (
        EXIT_USAGE, "", f"datastates-hist: {target} exists: use --force to replace it\n")
    shutil.copytree(target, tmp_path / "step.dcp.replaced")  # as an export cut off in its rename leaves it
    assert cli(capsys, "export", run, 2, "--to", target, "--force")[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["run", "step.dcp"]  # the old checkpoint, moved aside, gone once the new one is in
    state = make_model().state_dict()
    dcp_load(state, target)
    assert torch.equal(state["0.weight"], model.state_dict()["0.weight"])


def test_unknown_target_names_the_formats(tmp_path, trained, capsys):
    run, _, _ = trained
    target = tmp_path / "out.npz"
    assert cli(capsys, "export", run, 0, "--to", target) == (
        EXIT_USAGE, "", f"datastates-hist: cannot write {target}: export writes .safetensors, .pt, .pth, .dcp files "
        "(or say which with --format)\n")


def test_force_replaces_only_a_dcp_checkpoint(tmp_path, trained, capsys):
    run, model, _ = trained
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("precious")
    assert cli(capsys, "export", run, 2, "--to", project, "--format", "dcp", "--force") == (
        EXIT_USAGE, "", f"datastates-hist: cannot replace {project}: it is not a DCP checkpoint (a folder of "
        ".metadata and *.distcp files only), and --force replaces nothing else with one\n")
    assert (project / "train.py").read_text() == "precious"
    target = tmp_path / "step.dcp"
    assert cli(capsys, "export", run, 0, "--to", target)[0] == 0
    (target / "notes.txt").write_text("mine")  # no longer DCP's files only
    assert cli(capsys, "export", run, 2, "--to", target, "--force")[0] == EXIT_USAGE
    assert (target / "notes.txt").read_text() == "mine"
    folder = tmp_path / "out.pt"
    folder.mkdir()
    assert cli(capsys, "export", run, 2, "--to", folder, "--force") == (
        EXIT_USAGE, "", f"datastates-hist: cannot replace {folder}: it is a folder, and --force replaces only a "
        "file with a file\n")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".dcp"])
def test_stale_temporary_is_removed_never_followed(tmp_path, trained, capsys, suffix):
    run, model, _ = trained
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    target = tmp_path / f"out{suffix}"
    os.symlink(precious, f"{target}.partial")  # a planted (or stale) link where the temporary goes
    assert cli(capsys, "export", run, 2, "--to", target) == (0, f"wrote 9 tensors of step 2 to {target}\n", "")
    assert precious.read_text() == "keep me"
    assert not os.path.lexists(f"{target}.partial")
    other = tmp_path / f"other{suffix}.partial"
    other.mkdir()
    (other / "data.txt").write_text("mine")
    assert cli(capsys, "export", run, 2, "--to", tmp_path / f"other{suffix}") == (
        EXIT_USAGE, "", f"datastates-hist: cannot write beside {other}: a folder is there that no export left; "
        "move it away\n")
    assert (other / "data.txt").read_text() == "mine"


def every_dtype(but=()):
    """A module holding a buffer of each dtype the store holds, named ``t_`` and the dtype
    (a module's own methods take the bare names: bfloat16(), bool())."""
    from datastates_hist.dtypes import STORABLE

    module = torch.nn.Module()
    for dtype in sorted(STORABLE - set(but), key=str):
        values = torch.tensor([1 + 2j, -3.5 - 4j]) if dtype.is_complex else torch.tensor([0.0, 1.0, 3.0])
        module.register_buffer("t_" + str(dtype).removeprefix("torch."), values.to(dtype))
    return module


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_each_format_takes_every_dtype_it_can_and_safetensors_refuses_complex128(tmp_path, backend, capsys):
    """safetensors has no complex128: the refusal comes before anything is written, where its
    own error was a bare KeyError (exit 3, "does not exist"); torch and DCP take every dtype."""
    run = tmp_path / "run"
    model, lacking = every_dtype(), every_dtype(but=[torch.complex128])
    with dh.Checkpointer(run, backend=backend) as ckpt:
        ckpt.write(0, model, z=torch.zeros(2, dtype=torch.complex128))
        ckpt.write(1, lacking)
    target = tmp_path / "out.safetensors"
    assert cli(capsys, "export", run, 0, "--to", target) == (
        EXIT_USAGE, "", "datastates-hist: safetensors cannot store tensor 't_complex128' of dtype complex128; export it "
        "--to a .pt file or a DCP folder (.dcp)\n")
    assert cli(capsys, "export", run, 0, "--to", target, "--all") == (
        EXIT_USAGE, "", "datastates-hist: safetensors cannot store 2 tensors of dtype complex128: model/t_complex128, "
        "extra/z; export them --to a .pt file or a DCP folder (.dcp)\n")
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no file, no temporary

    from safetensors.torch import load_file

    assert cli(capsys, "export", run, 1, "--to", target)[0] == 0  # every other dtype
    exported = load_file(str(target))
    assert sorted(exported) == sorted(lacking.state_dict())
    assert all(same_bits(exported[name], t) for name, t in lacking.state_dict().items())
    assert cli(capsys, "export", run, 0, "--to", tmp_path / "out.pt")[0] == 0
    exported = torch.load(tmp_path / "out.pt")
    assert sorted(exported) == sorted(model.state_dict())
    assert all(same_bits(exported[name], t) for name, t in model.state_dict().items())
    assert cli(capsys, "export", run, 0, "--to", tmp_path / "out.dcp")[0] == 0
    state = {name: torch.empty_like(t) for name, t in model.state_dict().items()}
    dcp_load(state, tmp_path / "out.dcp")
    assert all(same_bits(state[name], t) for name, t in model.state_dict().items())
