"""Lightning: every optimizer step of a real ``lightning.Trainer`` into a history
(``HistoryCheckpoint`` and its ``CheckpointIO``), and a SIGKILLed run resumed bit-exact.

The runs train examples/train_lightning.py's GPT (tiny) on CPU, on one thread, with its resumable
loader (Lightning stores its position with every step, so the data order is restored exactly).
"""

import os
import pickle
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch

import datastates_hist as dh
import train_lightning
from datastates_hist.integrations.lightning import HistoryCheckpoint, HistoryCheckpointIO
from datastates_hist.store import Store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
STEPS = 12
KILL_AFTER = 4  # committed steps before the kill
SMALL = ["--size", "tiny", "--block-size", "16", "--batch-size", "2", "--corpus-bytes", str(1 << 18),
         "--batches-per-epoch", "5", "--threads", "1", "--steps", str(STEPS)]  # epochs of 5 batches

# The killed run: the example's training, slowed down from KILL_AFTER on (numbers unchanged) so
# that the kill lands while it trains.
KILLED = """
import sys, time
sys.path[:0] = [{examples!r}]
import lightning as L
import train_lightning

class Slow(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= {after}:
            time.sleep(0.3)

train_lightning.train(train_lightning.build_parser().parse_args({argv!r}), callbacks=[Slow()])
"""


def args_for(run_dir, backend, *more):
    return [*SMALL, "--run-dir", run_dir, "--backend", backend, *more]


def train(argv, callbacks=()):
    """The example's training in this process (its --threads undone after)."""
    threads = torch.get_num_threads()
    try:
        return train_lightning.train(train_lightning.build_parser().parse_args(argv), callbacks=callbacks)
    finally:
        torch.set_num_threads(threads)


def build_run(run_dir, backend):
    """The uninterrupted run: steps 1..STEPS, with the example's default policies."""
    train(args_for(run_dir, backend))


def step_state(run_dir, step):
    store = Store(run_dir)
    with store.open_step(step) as data:
        tensors = {name: data.read(name) for name in data.records}
        values = data.values["items"]
    store.close()
    return tensors, values


def committed(run_dir):
    try:
        store = Store(run_dir)
    except dh.StoreNotFoundError:  # not yet created, or being created by the writer
        return []
    try:
        return store.steps()
    finally:
        store.close()


def test_every_step_is_written(module_runs, backend):
    run = module_runs(backend)
    h = dh.open(run)
    assert h.steps == list(range(1, STEPS + 1))
    assert h.restore_points == [STEPS - 1, STEPS]  # KeepLast(2); the rest keep the model's weights
    names = h.names(STEPS)
    assert "model/model.head.weight" in names
    assert "extra/lightning/optimizer_states/0/state/0/exp_avg" in names
    assert set(h.names(1)) == {n for n in names if n.startswith("model/")}
    scalars = h.scalars()
    assert list(scalars["extra/lightning/global_step"]) == list(range(1, STEPS + 1))
    assert scalars["extra/data/loss"].notna().all()
    assert list(scalars["extra/lightning/loops/fit_loop/state_dict/combined_loader/0/position"]) == \
        [(s - 1) % 5 + 1 for s in range(1, STEPS + 1)]  # the loader's place in its epoch
    h.close()


def test_every_step_holds_the_state_it_was_saved_with(backend, tmp_path):
    """The lazy snapshot copies each step before training changes it: every step stored equals the
    model and optimizer as they were at the end of its batch (copied then by a callback)."""
    run = str(tmp_path / "run")
    seen = {}

    class Copy(L.Callback):  # runs before HistoryCheckpoint, which Lightning puts last
        def on_train_batch_end(self, trainer, pl_module, *args):
            state = trainer.optimizers[0].state_dict()["state"]
            seen[trainer.global_step] = (
                {k: v.clone() for k, v in pl_module.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()})

    train(args_for(run, backend, "--steps", "4", "--keep-all"), callbacks=[Copy()])
    assert committed(run) == sorted(seen) == [1, 2, 3, 4]
    for step, (model, optimizer) in seen.items():
        tensors, values = step_state(run, step)
        assert values["extra/lightning"]["global_step"] == step
        assert all(torch.equal(tensors[f"model/{k}"], v) for k, v in model.items()), step
        assert all(torch.equal(tensors[f"extra/lightning/optimizer_states/0/state/{i}/{k}"], v)
                   for i, s in optimizer.items() for k, v in s.items()), step


def test_killed_run_resumes_bit_exact(module_runs, backend, tmp_path):
    full = module_runs(backend)
    run = str(tmp_path / "killed")
    argv = args_for(run, backend)
    proc = subprocess.Popen([sys.executable, "-c", KILLED.format(examples=EXAMPLES, after=KILL_AFTER, argv=argv)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(committed(run)) < KILL_AFTER:  # poll the index: kill once steps are committed
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the run committed no steps in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = committed(run)[-1]
    assert KILL_AFTER <= killed_at < STEPS  # mid-way

    result = train([*argv, "--resume"])  # in this process: a fresh Trainer, model and loader
    assert result["start_step"] == killed_at  # the newest step is a restore point (KeepLast)
    assert committed(run) == list(range(1, STEPS + 1))

    want, want_values = step_state(full, STEPS)
    got, got_values = step_state(run, STEPS)
    assert want.keys() == got.keys()
    assert sum(n.startswith("model/") for n in want) > 10
    for name in want:  # the model, the optimizer's state, the RNG: bit for bit
        a, b = (t.reshape(-1).view(torch.uint8) for t in (want[name], got[name]))
        assert torch.equal(a, b), name
    # loops, schedulers, data position, RNG, the loss logged: the same values
    assert want_values == got_values


def test_load_reads_no_pickle(module_runs, monkeypatch):
    run = module_runs("adios2")
    want, _ = step_state(run, STEPS)

    def refuse(*args, **kwargs):
        raise AssertionError("a history is read without pickle")
    for module, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(module, name, refuse)
    checkpoint = HistoryCheckpointIO(run).load_checkpoint(run)
    assert checkpoint["global_step"] == STEPS
    assert checkpoint["state_dict"].keys() == {n[6:] for n in want if n.startswith("model/")}
    assert all(torch.equal(t, want[f"model/{k}"]) for k, t in checkpoint["state_dict"].items())
    optimizer = checkpoint["optimizer_states"][0]
    assert sorted(optimizer["state"])[:2] == [0, 1]  # torch's format: state by parameter index
    assert torch.equal(optimizer["state"][0]["exp_avg"], want["extra/lightning/optimizer_states/0/state/0/exp_avg"])
    assert checkpoint["hyper_parameters"]["size"] == "tiny"
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 2, "position": 2}]


def test_the_model_restores_without_lightning(module_runs):
    """A plain Checkpointer restores the LightningModule's weights (stored by their state_dict names)."""
    run = module_runs("adios2")
    want, _ = step_state(run, STEPS)
    module = train_lightning.GPTModule("tiny", 16)
    with dh.Checkpointer(run) as ckpt:
        assert ckpt.restore(model=module, rng=False).step == STEPS
    assert all(torch.equal(want[f"model/{k}"], v) for k, v in module.state_dict().items())


def test_a_step_by_number(module_runs):
    run = module_runs("adios2")
    io = HistoryCheckpointIO(run, rng=False)
    assert io.load_checkpoint(f"{run}:{STEPS - 1}")["global_step"] == STEPS - 1
    with pytest.raises(dh.StepNotFoundError, match=f"^step 3 of {run} is a trajectory point, not a restore point"):
        io.load_checkpoint(f"{run}:3")
    with pytest.raises(dh.StepNotFoundError):
        io.load_checkpoint(f"{run}:{STEPS + 5}")


def test_a_history_not_written_by_lightning_is_refused(tmp_path):
    run = str(tmp_path / "plain")
    with dh.Checkpointer(run) as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError) as err:
        HistoryCheckpointIO(run).load_checkpoint(run)
    assert str(err.value) == (f"cannot load {run!r} into Lightning: its step 0 was not written through "
                              "HistoryCheckpointIO (it holds no Lightning checkpoint)")


def test_model_checkpoint_files_beside_the_history(tmp_path):
    """Other paths (ModelCheckpoint's .ckpt files) are saved by Lightning's TorchCheckpointIO."""
    run, files = str(tmp_path / "run"), str(tmp_path / "files")
    train(args_for(run, "adios2", "--steps", "2"),
          callbacks=[L.pytorch.callbacks.ModelCheckpoint(files, every_n_train_steps=1)])
    assert committed(run) == [1, 2]
    assert os.listdir(files) == ["epoch=0-step=2.ckpt"]
    checkpoint = torch.load(os.path.join(files, "epoch=0-step=2.ckpt"), weights_only=False)
    tensors, _ = step_state(run, 2)
    assert all(torch.equal(tensors[f"model/{k}"], v) for k, v in checkpoint["state_dict"].items())


def test_resume_path(tmp_path):
    history = HistoryCheckpoint(str(tmp_path / "run"))
    assert history.resume_path() is None  # nothing yet: a fresh start
    with dh.Checkpointer(str(tmp_path / "run")) as ckpt:
        ckpt.write(4, torch.nn.Linear(2, 2))
    assert history.resume_path() == str(tmp_path / "run")
    assert history.resume_path(4) == f"{tmp_path / 'run'}:4"


class Odd:
    """A hyper-parameter JSON cannot hold."""


class OddModule(train_lightning.GPTModule):
    def __init__(self, odd=Odd()):
        super().__init__("tiny", 16)
        self.save_hyperparameters()


def fit_one_step(module, callbacks, plugins, tmp_path):
    corpus = torch.arange(256, dtype=torch.uint8).repeat(8)
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, plugins=plugins, default_root_dir=str(tmp_path))
    trainer.fit(module, train_lightning.Windows(corpus, 2, 16, 4, 0))


def test_a_value_json_cannot_hold_is_refused(tmp_path):
    history = HistoryCheckpoint(str(tmp_path / "run"))
    with pytest.raises(TypeError) as err:
        fit_one_step(OddModule(), [history], [history.checkpoint_io], tmp_path)
    assert str(err.value) == (
        "cannot checkpoint 'extra/lightning': value/hyper_parameters/odd: a value of type "
        "test_integration_lightning.Odd cannot be stored without pickle; convert it to numbers, strings, "
        "lists and dicts, give it state_dict()/load_state_dict(), or register a StateProvider for its type")
    assert committed(str(tmp_path / "run")) == []


def test_the_plugin_is_required(tmp_path):
    history = HistoryCheckpoint(str(tmp_path / "run"))
    with pytest.raises(ValueError) as err:
        fit_one_step(train_lightning.GPTModule("tiny", 16), [history], [], tmp_path)
    assert str(err.value) == ("HistoryCheckpoint saves through its own CheckpointIO: pass it to the Trainer too, "
                              "Trainer(callbacks=[history], plugins=[history.checkpoint_io])")


def test_bad_arguments(tmp_path):
    run = str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"^every_n_steps must be a positive int, got 0$"):
        HistoryCheckpoint(run, every_n_steps=0)
    with pytest.raises(TypeError, match=r"^HistoryCheckpointIO: got an unexpected keyword argument 'kepe' "
                                        r"\(options are the Checkpointer's\)$"):
        HistoryCheckpointIO(run, kepe=dh.KeepLast(2))
    io = HistoryCheckpointIO(run)
    with pytest.raises(ValueError, match=r"^HistoryCheckpointIO takes storage_options=\{'data': \{\.\.\.\}\} "
                                         r"\(plain values stored with the step\), got \{'loss': 1\.0\}$"):
        io.save_checkpoint({"global_step": 1, "state_dict": {}}, run, storage_options={"loss": 1.0})
    with dh.Checkpointer(run) as ckpt:
        ckpt.write(0, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError) as err:
        io.save_checkpoint({"global_step": 1, "state_dict": {}}, f"{run}:1")
    assert str(err.value) == (f"cannot save a Lightning checkpoint to '{run}:1': this HistoryCheckpointIO writes "
                              f"the history '{run}', whose steps are numbered by trainer.global_step; save to that "
                              "run directory")
    with pytest.raises(ValueError) as err:
        io.remove_checkpoint(run)
    assert str(err.value) == (f"cannot remove '{run}': which steps of a history stay is decided by its retention "
                              "policies (keep=, trajectory=) or by `datastates-hist prune`")


class Saved(L.Callback):
    """Every tensor of each checkpoint dict as Lightning made it at the save, by its stored name
    (its on_save_checkpoint runs when the dict is dumped, before the history stores it)."""

    def __init__(self):
        self.steps = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        tensors = {}

        def walk(value, name):
            if isinstance(value, torch.Tensor):
                tensors[name] = value.detach().clone()
            elif isinstance(value, dict):
                for key, item in value.items():
                    walk(item, f"{name}/{key}")
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    walk(item, f"{name}/{i}")
        for key, value in checkpoint.items():
            walk(value, "model" if key == "state_dict" else f"extra/lightning/{key}")
        self.steps[checkpoint["global_step"]] = tensors


class Wide(L.LightningModule):
    """A layer big enough that its copy is still running when the next hooks come, and a
    BatchNorm built in ``__init__`` or in ``configure_model``."""

    def __init__(self, norm_in_configure_model=False):
        super().__init__()
        self.wide = torch.nn.Linear(1024, 1024)
        self.norm_in_configure_model = norm_in_configure_model
        if not norm_in_configure_model:
            self.norm = torch.nn.BatchNorm1d(1024)

    def configure_model(self):
        if self.norm_in_configure_model and not hasattr(self, "norm"):
            self.norm = torch.nn.BatchNorm1d(1024)

    def forward(self, x):
        return self.norm(self.wide(x))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit_wide(module, history, tmp_path, callbacks=(), val=False, max_steps=6, ckpt_path=None):
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 1024) * 3 + 1), batch_size=8)
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", callbacks=[*callbacks, history], plugins=[history.checkpoint_io],
                        default_root_dir=str(tmp_path), num_sanity_val_steps=0,
                        **({"val_check_interval": 1, "limit_val_batches": 1} if val else {}))
    trainer.fit(module, data, data if val else None, ckpt_path=ckpt_path)
    return trainer


def assert_stored_as_saved(run, saved):
    assert committed(run) == sorted(saved)
    for step, want in saved.items():
        tensors, _ = step_state(run, step)
        assert want.keys() <= tensors.keys()
        for name, tensor in want.items():
            assert torch.equal(tensors[name], tensor), (step, name)


def test_validation_that_swaps_weights_in_place(tmp_path):
    """EMAWeightAveraging copies the averaged weights into the model (.data.copy_()) when validation
    starts and when training ends: each step stored holds the weights as they were at its save."""
    run, saved = str(tmp_path / "run"), Saved()
    ema = L.pytorch.callbacks.EMAWeightAveraging(decay=0.5)
    fit_wide(Wide(), HistoryCheckpoint(run, codec="raw"), tmp_path, [ema, saved], val=True)
    assert sorted(saved.steps) == [1, 2, 3, 4, 5, 6]
    assert any("current_model_state" in name for name in saved.steps[6])  # EMA's own copy, stored too
    assert_stored_as_saved(run, saved.steps)


def test_buffers_built_in_configure_model(tmp_path):
    """A BatchNorm built in configure_model (after setup): its statistics, changed by the next
    forward, are stored as they were at the save."""
    run, saved = str(tmp_path / "run"), Saved()
    fit_wide(Wide(norm_in_configure_model=True), HistoryCheckpoint(run, codec="raw"), tmp_path, [saved])
    assert "model/norm.running_mean" in saved.steps[6]
    assert_stored_as_saved(run, saved.steps)


def test_every_n_steps_saves_the_last_step(tmp_path):
    run = str(tmp_path / "run")
    fit_wide(Wide(), HistoryCheckpoint(run, every_n_steps=4), tmp_path, max_steps=6)
    assert committed(run) == [4, 6]


def test_a_save_after_fit_at_the_same_step(tmp_path):
    run = str(tmp_path / "run")
    trainer = fit_wide(Wide(), HistoryCheckpoint(run), tmp_path, max_steps=2)
    with pytest.raises(dh.StepOrderError) as err:
        trainer.save_checkpoint(run)
    assert str(err.value) == (
        f"cannot save the checkpoint of trainer.global_step 2 to {run!r}: the history already holds step 2, "
        "and its steps only grow (one per global step; to branch from an earlier step, call "
        "checkpoint_io.checkpointer.truncate(after=...) first)")
    with dh.Checkpointer(run) as ckpt:  # the writer lock was given back
        assert ckpt.steps() == [1, 2]


def test_a_fit_from_before_the_newest_step_is_refused_before_it_trains(tmp_path):
    run = str(tmp_path / "run")
    fit_wide(Wide(), HistoryCheckpoint(run), tmp_path, max_steps=3)
    module = Wide()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(dh.StepOrderError) as err:
        fit_wide(module, HistoryCheckpoint(run), tmp_path, max_steps=6)  # no ckpt_path: from step 0
    assert str(err.value) == (
        f"{run} already holds steps up to 3 and the fit starts at trainer.global_step 0: resume with "
        "trainer.fit(..., ckpt_path=history.resume_path()), or write to a new directory (to branch from an "
        "earlier step, call history.checkpoint_io.checkpointer.truncate(after=...) first)")
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # no update trained
    history = HistoryCheckpoint(run)
    fit_wide(Wide(), history, tmp_path, max_steps=6, ckpt_path=history.resume_path())
    assert committed(run) == [1, 2, 3, 4, 5, 6]


def test_resume_path_names_the_restore_points(tmp_path):
    run = str(tmp_path / "run")
    history = HistoryCheckpoint(run)
    with pytest.raises(dh.StoreNotFoundError):
        history.resume_path(3)
    with dh.Checkpointer(run, keep=dh.KeepEvery(4), trajectory=dh.Trajectory("model/*")) as ckpt:
        for step in range(1, 10):
            ckpt.write(step, torch.nn.Linear(2, 2))
    assert history.resume_path(4) == f"{run}:4"
    with pytest.raises(dh.StepNotFoundError) as err:
        history.resume_path(6)
    assert str(err.value) == (f"step 6 of {run} is a trajectory point, not a restore point: it keeps 2 tensor(s) to "
                              "read, not the whole state. The nearest restore points: 4 and 8")
    with pytest.raises(dh.StepNotFoundError) as err:
        history.resume_path(12)
    assert str(err.value) == (f"step 12 is not committed in {run} (committed steps: 1..9 (9)). "
                              "The nearest restore point: 9")  # the newest step stays one


def test_resume_from_a_step_that_is_no_restore_point(tmp_path):
    """The example checks --resume-from before it drops the later steps."""
    run = str(tmp_path / "run")
    train(args_for(run, "adios2", "--steps", "4"))  # KeepLast(2): restore points 3 and 4
    with pytest.raises(SystemExit) as err:
        train(args_for(run, "adios2", "--steps", "4", "--resume-from", "2"))
    assert str(err.value) == (f"--resume-from 2: step 2 of {run} is a trajectory point, not a restore point: it "
                              f"keeps {len(dh.open(run).names(2))} tensor(s) to read, not the whole state. "
                              "The nearest restore point: 3")
    assert committed(run) == [1, 2, 3, 4]
    assert dh.open(run).restore_points == [3, 4]


@pytest.mark.parametrize("stored, why", [
    ("oops", "is of type str, not Lightning's checkpoint dict"),
    ([1, 2], "is of type list, not Lightning's checkpoint dict"),
    (5, "is of type int, not Lightning's checkpoint dict"),
    ({"global_step": 3, "loops": 3}, "has no 'epoch'"),
    ({"epoch": 0, "global_step": "x", "pytorch-lightning_version": "2.6"},
     "has a 'global_step' of type str, not int"),
])
def test_a_malformed_lightning_entry_is_refused(tmp_path, stored, why):
    from datastates_hist.integrations.lightning import LightningModelState
    run = str(tmp_path / "run")
    torch.manual_seed(1)
    with dh.Checkpointer(run) as ckpt:
        ckpt.write(0, LightningModelState({"w": torch.zeros(2)}), lightning=stored)
    torch.manual_seed(2)
    rng = torch.get_rng_state()
    with pytest.raises(ValueError) as err:
        HistoryCheckpointIO(run).load_checkpoint(run)
    assert str(err.value) == (f"cannot load {run!r} into Lightning: its step 0 was not written through "
                              f"HistoryCheckpointIO (it holds no Lightning checkpoint: extra/lightning {why})")
    assert torch.equal(torch.get_rng_state(), rng)  # the RNG is left as it was
