"""``datastates-hist diff`` ranks by group on a real run: the example GPT trained with
AdamW, whose moments (``optim/state/*/exp_avg``, ``exp_avg_sq``) change relatively more
than any weight. The model's tensors come first, then other objects' (``extra/``), then
the optimizer's state, each group most changed first; ``--top N`` gives the model's most
changed tensors; ``--names 'optim/*'`` ranks the optimizer's state alone."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import datastates_hist as dh
from datastates_hist.cli.diff import METRICS, MOST_CHANGED_FIRST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "datastates_hist.cli", *args], capture_output=True, text=True)


def ranked(run, *args):
    out = cli("diff", run, *args, "--json")
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """Steps 0..2 of the example GPT (tiny), every step a restore point (the newest two by
    the example's policies, step 0 as the first of every 1000)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt

    run = str(tmp_path_factory.mktemp("diff-rank") / "gpt")
    args = train_gpt.build_parser().parse_args(
        ["--size", "tiny", "--steps", "3", "--block-size", "32", "--batch-size", "4",
         "--corpus-bytes", str(1 << 20), "--run-dir", run, "--log-every", "100"])
    train_gpt.train(args)
    with dh.open(run) as h:
        assert h.restore_points == [0, 1, 2]
    return run


def group(name):
    return name.split("/")[0]


def assert_ranked_within_groups(rows, metric, groups):
    """``rows`` list the groups in the order ``groups``, each most changed first by ``metric``,
    NaN last of its group."""
    assert [group(r["name"]) for r in rows] == sorted((group(r["name"]) for r in rows), key=groups.index)
    for g in groups:
        values = [r[metric] for r in rows if group(r["name"]) == g]
        numbers = [v for v in values if not math.isnan(v)]
        assert values[:len(numbers)] == numbers, (metric, g)
        assert numbers == sorted(numbers, reverse=MOST_CHANGED_FIRST[metric] < 0), (metric, g)


def test_the_model_leads_though_the_optimizer_moments_change_most(gpt):
    rows = ranked(gpt, "-2", "-1")
    assert {group(r["name"]) for r in rows} == {"model", "optim"}
    moments = [r for r in rows if r["name"].endswith(("/exp_avg", "/exp_avg_sq"))]
    model = [r for r in rows if group(r["name"]) == "model"]
    assert len(moments) == 2 * len(model) and len(rows) == 3 * len(model)
    # the case: ranked all together, the first ten rows would be moments
    assert all(r in moments for r in sorted(rows, key=lambda r: -r["rel_l2"])[:10])
    for metric in METRICS:
        assert_ranked_within_groups(ranked(gpt, "-2", "-1", "--sort", metric), metric, ["model", "optim"])
    by_rel = sorted(model, key=lambda r: -r["rel_l2"])
    assert [r["name"] for r in rows[:len(model)]] == [r["name"] for r in by_rel]
    top = ranked(gpt, "-2", "-1", "--top", "5")
    assert top == rows[:5] and [r["name"] for r in top] == [r["name"] for r in by_rel[:5]]


def test_the_table_shows_the_model_first(gpt):
    out = cli("diff", gpt, "1", "2", "--top", "3")
    assert (out.returncode, out.stderr) == (0, "")
    names = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert names == [r["name"] for r in ranked(gpt, "1", "2")[:3]] and all(n.startswith("model/") for n in names)


def test_names_of_one_group_rank_it_alone(gpt):
    every = ranked(gpt, "-2", "-1", "--all")
    assert_ranked_within_groups(every, "rel_l2", ["model", "optim"])
    counters = [r["name"] for r in every if r["integral"]]
    assert counters and all(n.startswith("optim/state/") and n.endswith("/step") for n in counters)
    assert not set(counters) & {r["name"] for r in ranked(gpt, "-2", "-1")}
    optim = ranked(gpt, "-2", "-1", "--names", "optim/*")  # counters too: --names selects them
    assert optim == [r for r in every if group(r["name"]) == "optim"]


def test_other_objects_come_between_the_model_and_the_optimizer(tmp_path):
    """An extra object's tensors (an EMA of the weights) rank after the model's and before
    the optimizer's state, though they changed most of all."""
    run = str(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ema = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with dh.Checkpointer(run) as ckpt:
        for step in (0, 1):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step:
                with torch.no_grad():
                    for p in ema.parameters():
                        p.mul_(1e6)
            ckpt.write(step, model, opt, ema=ema)
    rows = ranked(run, "0", "1")
    assert [group(r["name"]) for r in rows] == ["model"] * 2 + ["extra"] * 2 + ["optim"] * 4
    assert_ranked_within_groups(rows, "rel_l2", ["model", "extra", "optim"])
    assert min(r["rel_l2"] for r in rows[2:4]) == pytest.approx(1e6 - 1)
    assert max(r["rel_l2"] for r in rows[:2] + rows[4:]) < 1e3
