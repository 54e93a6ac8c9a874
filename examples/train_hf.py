"""Train a small GPT-2 with the Hugging Face Trainer, every optimizer step into a history.

The model is a GPT-2 configuration with random weights (nothing is downloaded), trained
on byte tokens (a vocabulary of 256) of the Python standard library's source, or of
``--text FILE``. ``HistoryCallback`` writes every step into ``--run-dir``; run the same
command again after a crash (or a kill) and it resumes from the history's newest restore
point: Trainer goes on with the same batches and dropout masks, bit-exact. Run it again after
the run finished and it trains nothing (raise ``--steps`` to train on).

Example:
    python examples/train_hf.py --run-dir runs/hf --steps 200
    datastates-hist ls runs/hf
    datastates-hist trace runs/hf loss learning_rate
"""
import argparse
import os
import sys

import torch

# Let the example run from a source checkout without installing the package.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.append(_REPO_ROOT)
from train_gpt import load_corpus  # noqa: E402  (beside this file)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed  # noqa: E402

import datastates_hist as dh  # noqa: E402
from datastates_hist.integrations.transformers import HistoryCallback  # noqa: E402

# size -> (n_layer, n_embd, n_head)
SIZES = {"tiny": (2, 32, 2), "small": (4, 128, 4), "medium": (6, 384, 6)}  # 0.04M, 0.8M, 10.8M parameters
VOCAB = 256  # byte tokens


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of ``block_size`` byte tokens; the labels are the inputs
    (GPT2LMHeadModel shifts them)."""

    def __init__(self, corpus: torch.Tensor, block_size: int):
        count = len(corpus) // block_size
        if count == 0:
            raise ValueError(f"the text has {len(corpus)} bytes, fewer than one window of {block_size}")
        self.windows = corpus[:count * block_size].long().view(count, block_size)

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def build_model(size: str, block_size: int) -> GPT2LMHeadModel:
    """A GPT-2 of a named size with random weights (dropout 0.1: the RNG states matter)."""
    n_layer, n_embd, n_head = SIZES[size]
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=block_size, n_layer=n_layer, n_embd=n_embd,
                                      n_head=n_head, bos_token_id=None, eos_token_id=None))


def read_text(args) -> torch.Tensor:
    if args.text is None:
        return load_corpus(args.corpus_bytes)
    with open(args.text, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def history_policies(keep_all: bool) -> dict:
    """What the history keeps: the 2 newest restore points and every 1000th (step 0 among them),
    and the model's weights of every other step; every step a restore point with ``keep_all``."""
    if keep_all:
        return {}
    return {"keep": dh.KeepLast(2) | dh.KeepEvery(1000), "trajectory": dh.Trajectory("model/*", every=1)}


def build_trainer(args, callbacks=()) -> tuple[Trainer, HistoryCallback | None]:
    """The Trainer of ``args`` and its HistoryCallback (None with ``--no-history``);
    ``callbacks`` are more Trainer callbacks."""
    if args.threads:
        torch.set_num_threads(args.threads)
    set_seed(args.seed)
    model = build_model(args.size, args.block_size)
    history = None if args.no_history else HistoryCallback(
        args.run_dir, backend=args.backend, codec=args.codec, **history_policies(args.keep_all))
    trainer_saves = {"save_strategy": "steps", "save_steps": args.trainer_save_steps} \
        if args.trainer_save_steps else {"save_strategy": "no"}
    training_args = TrainingArguments(
        output_dir=args.output_dir or args.run_dir + ".trainer",
        max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
        warmup_steps=max(1, args.steps // 10), weight_decay=0.1, seed=args.seed,
        logging_steps=args.logging_steps, report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, **trainer_saves)
    trainer = Trainer(model=model, args=training_args, train_dataset=ByteWindows(read_text(args), args.block_size),
                      callbacks=([history] if history else []) + list(callbacks))
    return trainer, history


def train(args, callbacks=()) -> dict:
    """Train as ``args`` say, resuming from the history's newest restore point if it has one.

    Returns:
        ``{"start_step", "last_step", "train_loss"}`` (``train_loss`` None when the run was
        finished before: nothing was trained).
    """
    trainer, history = build_trainer(args, callbacks)
    try:
        resume = history.resume_from_checkpoint(trainer) if history else None
        if history and history.finished:
            print(f"finished: step {history.resumed_from} in {args.run_dir}; nothing to train "
                  "(raise --steps to train on)", flush=True)
            return {"start_step": history.resumed_from, "last_step": history.resumed_from, "train_loss": None}
        start = 0 if resume is None else history.resumed_from
        if resume:
            print(f"resumed from step {start} in {args.run_dir}", flush=True)
        else:
            print(f"starting in {args.run_dir}" if history else "starting without a history", flush=True)
        out = trainer.train(resume_from_checkpoint=resume)
    finally:  # an exception in Trainer leaves the history open: commit what was written
        if history:
            history.close()
    print(f"done: step {out.global_step} | train loss {out.training_loss:.4f}", flush=True)
    return {"start_step": start, "last_step": out.global_step, "train_loss": out.training_loss}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default="runs/hf", help="the history")
    p.add_argument("--output-dir", default=None, help="Trainer's output_dir (default: RUN_DIR.trainer)")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (Trainer's max_steps)")
    p.add_argument("--backend", choices=["adios2", "hdf5"], default="adios2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1, help="batches an optimizer step")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--text", default=None, help="train on this file's bytes (default: the standard library's source)")
    p.add_argument("--corpus-bytes", type=int, default=1 << 20)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--no-history", action="store_true", help="train without HistoryCallback")
    p.add_argument("--trainer-save-steps", type=int, default=0,
                   help="also let Trainer save its own checkpoint every N steps (0: never)")
    p.add_argument("--keep-all", action="store_true",
                   help="keep every step as a restore point (default: the policies of history_policies())")
    p.add_argument("--codec", choices=["delta", "key", "raw"], default="delta")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    return p


def main(argv=None, callbacks=()):
    """Parse ``argv`` and train."""
    return train(build_parser().parse_args(argv), callbacks)


if __name__ == "__main__":
    main()
