"""HistoryCallback (datastates_hist.integrations.transformers) with a real Trainer.

A GPT-2 with random weights trains on a text the test writes (examples/train_hf.py, on the
CPU). A run killed with SIGKILL mid-way, then run again, resumes from the history's newest
restore point and ends bit-exact with an uninterrupted run: the same loss at every step (the
same batches and dropout masks) and the same final weights, on both backends. Misuses of the
callback are refused with one clear error each.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import datastates_hist as dh
from datastates_hist.errors import StoreNotFoundError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_hf.py")
STEPS = 30
# 8 optimizer steps an epoch (see text()): the killed run and its resume cross epochs
TRAIN = ["--size", "tiny", "--steps", str(STEPS), "--block-size", "32", "--batch-size", "4",
         "--logging-steps", "1", "--threads", "1"]
KILL_AFTER = 10  # the killed run is killed once this step is committed
# the example, each step made slower by a callback, so that the test can kill it mid-way
SLOW_DRIVER = """
import sys, time
from transformers import TrainerCallback
import train_hf

class Slow(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.2)

train_hf.main(sys.argv[1:], callbacks=[Slow()])
"""


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A text of 1040 bytes: 32 windows of 32 bytes, 8 batches of 4 an epoch."""
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex jumbo crates".split()
    body = " ".join(rng.choice(words) for _ in range(400))[:1040]
    path = tmp_path_factory.mktemp("hf-text") / "text.txt"
    path.write_text(body)
    return str(path)


def example(*args, script=EXAMPLE, **popen):
    """The example (or ``script``) in a fresh process, from the examples' folder."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "examples"), ROOT])}
    return [sys.executable, script, *args], {"env": env, "text": True, **popen}


def run_example(*args):
    cmd, options = example(*args, capture_output=True)
    out = subprocess.run(cmd, timeout=600, **options)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def final_state(run_dir):
    """The history's steps, the loss of every step, and the model's weights at the last step."""
    with dh.open(run_dir) as h:
        last = h.steps[-1]
        losses = h.scalars()["extra/data/loss"].dropna().to_dict()
        names = [n for n in h.tensors(last)["name"] if n.startswith("model/")]
        return h.steps, losses, {n: torch.as_tensor(h.read(n, last)) for n in names}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, text):
    run_dir = str(tmp_path_factory.mktemp("hf-full") / "run")
    out = run_example("--run-dir", run_dir, "--text", text, *TRAIN)
    assert f"starting in {run_dir}" in out and f"done: step {STEPS}" in out
    return final_state(run_dir)


def newest_step(run_dir):
    try:
        with dh.open(run_dir) as h:
            steps = h.steps
    except StoreNotFoundError:  # the index is not there yet
        return None
    return steps[-1] if steps else None


def kill_after(proc, run_dir, step, timeout=300):
    """SIGKILL ``proc`` once ``step`` of ``run_dir`` is committed (polling its index)."""
    deadline = time.monotonic() + timeout
    while (newest_step(run_dir) or 0) < step:
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before step {step} was committed:\n"
                        f"{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"step {step} of {run_dir} was not committed in {timeout} s")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def test_killed_run_resumes_bit_exact(tmp_path, text, uninterrupted, backend):
    run_dir = str(tmp_path / "run")
    driver = tmp_path / "slow_train_hf.py"
    driver.write_text(SLOW_DRIVER)
    args = ["--run-dir", run_dir, "--backend", backend, "--text", text, *TRAIN]
    cmd, options = example(*args, script=str(driver), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    kill_after(subprocess.Popen(cmd, **options), run_dir, KILL_AFTER)
    killed_at = newest_step(run_dir)
    assert KILL_AFTER <= killed_at < STEPS

    out = run_example(*args)  # the same command again: it resumes
    resumed = int(re.search(r"resumed from step (\d+) in", out).group(1))
    assert resumed == killed_at  # the newest step is a restore point (KeepLast(2))
    assert f"done: step {STEPS}" in out
    assert os.listdir(run_dir + ".trainer") == []  # the resume folder is gone

    steps, losses, weights = final_state(run_dir)
    want_steps, want_losses, want_weights = uninterrupted
    assert steps == want_steps == list(range(STEPS + 1))
    with dh.open(run_dir) as h:
        assert h.restore_points == [0, STEPS - 1, STEPS]  # the example's policies
    # the same batches and dropout masks at every step: the same losses, to the bit
    assert losses == want_losses and len(losses) == STEPS
    assert weights.keys() == want_weights.keys() and len(weights) > 10
    for name, want in want_weights.items():
        assert torch.equal(weights[name].view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name


# --- in this process: what the callback writes, and its refusals ---------------------------

@pytest.fixture(scope="module")
def train_hf():
    import train_hf

    return train_hf


def trainer_of(train_hf, run_dir, text, steps=2):
    args = train_hf.build_parser().parse_args(
        ["--run-dir", run_dir, "--text", text, *TRAIN, "--steps", str(steps)])
    return train_hf.build_trainer(args)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, train_hf, text):
    """A history of a 2-step run of this process."""
    run_dir = str(tmp_path_factory.mktemp("hf-two") / "run")
    trainer, history = trainer_of(train_hf, run_dir, text)
    assert history.resume_from_checkpoint(trainer) is None  # a new history: nothing to resume
    trainer.train(resume_from_checkpoint=None)
    return run_dir, history


def test_every_step_is_written_with_the_trainer_state(two_steps):
    run_dir, history = two_steps
    assert history.checkpointer is None  # closed at the end of training: every step committed
    assert history.blocked_seconds > 0
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 2]
        scalars = h.scalars()
        names = list(h.tensors(2)["name"])
    assert scalars["extra/data/global_step"].tolist() == [0, 1, 2]
    assert scalars["extra/data/epoch"].tolist() == [0.0, 0.125, 0.25]
    assert scalars["extra/data/loss"].isna().tolist() == [True, False, False]
    assert {"model/transformer.wte.weight", "optim/state/transformer.wte.weight/exp_avg", "rng/torch"} <= set(names)
    # the optimizer inside accelerate's wrapper: AdamW's state of every parameter (lm_head's weight is
    # the embedding's), 3 tensors each
    optim = [n for n in names if n.startswith("optim/")]
    params = {n.split("/")[2] for n in optim}
    assert params == {n[6:] for n in names if n.startswith("model/")} - {"lm_head.weight"}
    assert len(optim) == 3 * len(params)


def test_a_new_run_on_a_used_history_is_refused(tmp_path, two_steps, train_hf, text):
    run_dir, _ = two_steps
    trainer, history = trainer_of(train_hf, run_dir, text)
    with pytest.raises(ValueError) as err:
        trainer.train()
    history.close()
    assert str(err.value) == (
        f"{run_dir} already holds steps up to 2 and the Trainer starts at step 0: resume with "
        "trainer.train(resume_from_checkpoint=history.resume_from_checkpoint(trainer)), or write to a new "
        "directory")


def test_a_callback_dropped_unused_holds_no_lock_and_one_added_twice_is_refused(tmp_path, train_hf, text):
    from datastates_hist.integrations.transformers import HistoryCallback

    run_dir = str(tmp_path / "run")
    args = train_hf.build_parser().parse_args(["--run-dir", run_dir, "--text", text, *TRAIN, "--no-history"])
    trainer, _ = train_hf.build_trainer(args)
    history = HistoryCallback(run_dir)
    history = HistoryCallback(run_dir)  # a notebook cell run again: the first callback is dropped, never closed
    trainer.add_callback(history)
    trainer.add_callback(history)
    with pytest.raises(ValueError) as err:
        trainer.train()
    history.close()
    assert str(err.value) == f"the HistoryCallback of {run_dir} is in the Trainer's callbacks twice; add it once"
    assert not os.listdir(os.path.join(run_dir, "steps"))


def test_a_train_that_raised_is_resumed_in_the_same_process_without_closing(tmp_path, train_hf, text):
    """The steps the failed train() left being written are committed before the resume looks
    for the newest (a commit slowed to make them still be in flight)."""
    from transformers import TrainerCallback

    import datastates_hist.commit as commit

    class FailOnce(TrainerCallback):
        fired = False

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3 and not FailOnce.fired:
                FailOnce.fired = True
                raise RuntimeError("a transient failure")

    slow, committing = commit.Committer.commit, []

    def slowed(self, *args, **kwargs):
        committing.append(1)
        time.sleep(0.3)
        return slow(self, *args, **kwargs)

    run_dir = str(tmp_path / "run")
    args = train_hf.build_parser().parse_args(["--run-dir", run_dir, "--text", text, *TRAIN, "--steps", "5"])
    trainer, history = train_hf.build_trainer(args, callbacks=[FailOnce()])
    commit.Committer.commit = slowed
    try:
        assert history.resume_from_checkpoint(trainer) is None
        with pytest.raises(RuntimeError, match="a transient failure"):
            trainer.train()
        assert history.resume_from_checkpoint(trainer) is not None
        assert history.resumed_from == 2  # step 3 is written as step 4 begins
        trainer.train(resume_from_checkpoint=history.resume_from_checkpoint(trainer))
    finally:
        commit.Committer.commit = slow
        history.close()
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 2, 3, 4, 5]


def test_a_resume_into_another_model_names_the_tensors_and_what_to_do(two_steps, train_hf, text):
    run_dir, _ = two_steps
    args = train_hf.build_parser().parse_args(["--run-dir", run_dir, "--text", text, *TRAIN, "--size", "small"])
    trainer, history = train_hf.build_trainer(args)
    with pytest.raises(dh.RestoreMismatchError) as err:
        history.resume_from_checkpoint(trainer)
    history.close()
    message = str(err.value).splitlines()
    assert message[0] == "step 2 does not match the objects to restore:"
    assert "  model/transformer.wte.weight: expected float32[256, 128], found float32[256, 32]" in message
    assert message[-1] == (f"the Trainer's model is not the model {run_dir} was written from: resume with that "
                           "model, or write to a new directory")
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 2]  # nothing truncated


def test_a_resume_not_passed_to_train_is_refused(two_steps, train_hf, text):
    run_dir, _ = two_steps
    trainer, history = trainer_of(train_hf, run_dir, text, steps=3)
    folder = history.resume_from_checkpoint(trainer)
    assert os.path.basename(folder) == "checkpoint-2" and history.resumed_from == 2
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors",
                                          "trainer_state.json", "training_args.bin"]  # Trainer's save_model
    with pytest.raises(RuntimeError) as err:
        trainer.train()
    history.close()
    assert str(err.value) == (
        f"the Trainer starts at step 0, not at step 2 of {run_dir}: pass history.resume_from_checkpoint(trainer) "
        "to trainer.train(resume_from_checkpoint=...)")
    assert not os.path.exists(os.path.dirname(folder))


def test_a_history_not_written_by_the_callback_is_refused(tmp_path, train_hf, text):
    run_dir = str(tmp_path / "run")
    trainer, history = trainer_of(train_hf, str(tmp_path / "other"), text)
    history.close()
    with dh.Checkpointer(run_dir) as ckpt:
        ckpt.write(0, trainer.model)
    from datastates_hist.integrations.transformers import HistoryCallback

    history = HistoryCallback(run_dir)
    with pytest.raises(ValueError) as err:
        history.resume_from_checkpoint(trainer)
    history.close()
    assert str(err.value) == (f"step 0 of {run_dir} holds no Trainer state (extra/trainer_state): its history "
                              "was not written by HistoryCallback")


def test_several_processes_are_refused(tmp_path):
    from datastates_hist.integrations.transformers import HistoryCallback

    history = HistoryCallback(str(tmp_path / "run"))
    with pytest.raises(ValueError) as err:
        history.on_train_begin(types.SimpleNamespace(world_size=2), None, None)
    history.close()
    assert str(err.value) == "HistoryCallback writes the history of one process; this Trainer runs 2 processes"


def test_the_last_step_holds_the_last_update_not_the_best_checkpoint(tmp_path, train_hf, text):
    """load_best_model_at_end loads step 2's weights before on_train_end: step 5 is written before."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from datastates_hist.integrations.transformers import HistoryCallback

    class Weights(TrainerCallback):
        after = {}  # the embedding after each update

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.after[state.global_step] = model.transformer.wte.weight.detach().clone()

    torch.set_num_threads(1)
    run_dir = str(tmp_path / "run")
    history = HistoryCallback(run_dir, codec="raw")
    with open(text, "rb") as f:
        data = train_hf.ByteWindows(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8), 32)
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=5, per_device_train_batch_size=4, learning_rate=1e-2,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=True,  # the best: the highest loss, step 2's
        report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=1)
    trainer = Trainer(model=train_hf.build_model("tiny", 32), args=args, train_dataset=data, eval_dataset=data,
                      callbacks=[Weights(), history])
    trainer.train(resume_from_checkpoint=history.resume_from_checkpoint(trainer))
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert torch.equal(trainer.model.transformer.wte.weight, Weights.after[2])  # Trainer loaded the best
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 2, 3, 4, 5] and 5 in h.restore_points
        stored = {s: torch.as_tensor(h.read("model/transformer.wte.weight", s)) for s in h.steps[1:]}
        assert h.scalars()["extra/data/train_loss"].dropna().index.tolist() == [5]  # the training summary
    for step, weights in stored.items():
        assert torch.equal(weights, Weights.after[step]), step
    assert not torch.equal(stored[5], Weights.after[2])


def test_the_folder_of_a_crashed_resume_is_replaced(two_steps, train_hf, text):
    run_dir, _ = two_steps
    trainer, history = trainer_of(train_hf, run_dir, text, steps=3)
    resume_dir = os.path.dirname(history.resume_from_checkpoint(trainer))
    history.close()
    assert not os.path.exists(resume_dir)
    output_dir = trainer.args.output_dir
    assert os.path.dirname(resume_dir) == output_dir and os.path.basename(resume_dir).startswith(".datastates-resume-")
    # a resume killed before training began, and the resume folder of another history in the same output_dir
    os.makedirs(os.path.join(resume_dir, "checkpoint-1"))
    other = os.path.join(output_dir, ".datastates-resume-0123456789abcdef")
    os.makedirs(other)

    trainer, history = trainer_of(train_hf, run_dir, text, steps=3)
    folder = history.resume_from_checkpoint(trainer)
    assert folder == os.path.join(resume_dir, "checkpoint-2")  # the same name: derived from the history
    assert os.listdir(resume_dir) == ["checkpoint-2"]
    history.close()
    assert not os.path.exists(resume_dir)
    assert os.path.isdir(other)
    os.rmdir(other)


def test_the_resume_folder_is_not_pushed_to_the_hub(two_steps, train_hf, text):
    run_dir, _ = two_steps
    trainer, history = trainer_of(train_hf, run_dir, text, steps=3)
    trainer.args.push_to_hub = True  # set after the Trainer was made: it would create a Hub repository

    def push_to_hub(*args, **kwargs):
        raise AssertionError("pushed to the Hub")

    trainer.push_to_hub = push_to_hub
    try:
        folder = history.resume_from_checkpoint(trainer)
    finally:
        history.close()
    assert os.path.basename(folder) == "checkpoint-2"


def test_a_finished_run_is_not_trained_again(two_steps, train_hf, text, capsys):
    run_dir, _ = two_steps
    trainer, history = trainer_of(train_hf, run_dir, text)  # max_steps 2: the history's last step
    assert history.resume_from_checkpoint(trainer) is None
    assert history.finished and history.resumed_from == 2
    with dh.open(run_dir) as h:
        want = torch.as_tensor(h.read("model/transformer.wte.weight", 2))
    assert torch.equal(trainer.model.transformer.wte.weight.detach(), want)  # the model holds the last step
    with pytest.raises(ValueError) as err:
        trainer.train()
    history.close()
    assert str(err.value) == (f"{run_dir} is finished: its step 2 reached the Trainer's max_steps (2); raise "
                              "max_steps to train on, or write to a new directory")
    assert os.listdir(trainer.args.output_dir) == []  # no resume folder

    args = train_hf.build_parser().parse_args(["--run-dir", run_dir, "--text", text, *TRAIN, "--steps", "2"])
    assert train_hf.train(args) == {"start_step": 2, "last_step": 2, "train_loss": None}
    assert capsys.readouterr().out == (f"finished: step 2 in {run_dir}; nothing to train (raise --steps to train "
                                       "on)\n")
    with dh.open(run_dir) as h:
        assert h.steps == [0, 1, 2]
