"""The training behind the runs in tests/fixtures/old_formats/, and a description of what
a reader gives back that can be compared and stored as JSON.

The runs were written by the code of each earlier format version (write_old.py there), so
this module imports only torch and numpy: it must run under the old code too.
"""
import hashlib
import json
import random

import numpy as np
import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)
        # fewer mantissa bits than keep_bits=8, and an integer 0-d buffer
        self.register_buffer("scale_bf16", torch.ones(4, dtype=torch.bfloat16))
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.scale_bf16.float()


def make(seed=0):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train_step(model, opt, sched):
    x = torch.randn(5, 8)
    y = torch.randn(5, 4)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    with torch.no_grad():
        model.counter += 1
        model.scale_bf16.mul_(torch.tensor(1.0078125, dtype=torch.bfloat16))
    np.random.rand()
    random.random()
    return loss.item()


def extras(step, loss):
    """Keyword extras for write(): plain values, numpy scalars, a tuple, bytes, a dict that
    looks like format 6's numpy tag (a plain dict before it), a tensor, numpy arrays."""
    data = {
        "epoch": step // 4,
        "batch": step % 4,
        "loss": loss,
        "nan": float("nan"),
        "inf": float("-inf"),
        "np_f32": np.float32(0.1 * (step + 1)),
        "np_f64": np.float64(1.0 / 3.0),
        "np_i64": np.int64(step * 1000),
        "np_u8": np.uint8(200),
        "np_bool": np.bool_(step % 2 == 0),
        "pair": (step, "a", 2.5),
        "blob": bytes([0, 1, 2, 255, step % 256]),
        "nested": {"list": [1, 2.0, None, True, "x"], "tup": ((1, 2), [3])},
        "looks_like_tag": {"__numpy__": ["float32", 1.5]},
    }
    return {
        "data": data,
        "tens": torch.arange(6, dtype=torch.float32).reshape(2, 3) * (step + 1),
        "arr": np.arange(5, dtype=np.int32) + step,
        "arr0d": np.array(step * 1.5, dtype=np.float64),
    }


def describe_rng(state=None):
    """The RNG states (torch, numpy, Python) described, ``state`` or the current ones; the
    Python state's 625 words by their digest."""
    if state is None:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                 "python": random.getstate()}
    python = json.dumps(describe(state["python"])).encode()
    return {"torch": describe(state["torch"]), "numpy": describe(state["numpy"]),
            "python": ["digest", _digest(python)]}


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:24]  # 96 bits: plenty to tell two values apart


def describe(value):
    """``value`` as JSON that keeps its type, its dtype and its exact bits (tensors and arrays
    by a SHA-256 of their bytes): two values are the same iff their descriptions are equal."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ["tensor", str(t.dtype), list(t.shape), _digest(raw)]
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        return ["ndarray", a.dtype.str, list(a.shape), _digest(a.tobytes())]
    if isinstance(value, np.generic):
        return ["numpy", np.asarray(value).dtype.str, np.asarray(value).tobytes().hex()]
    if value is None:
        return ["none"]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", str(value)]
    if isinstance(value, float):
        return ["float", value.hex()]
    if isinstance(value, str):
        return ["str", value]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    if isinstance(value, tuple):
        return ["tuple", [describe(v) for v in value]]
    if isinstance(value, list):
        return ["list", [describe(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[describe(k), describe(v)] for k, v in value.items()]]
    raise TypeError(f"cannot describe a {type(value).__name__}")
