"""The static check of training scripts.

Truth: each bad fixture marks its one planted mistake with ``# PLANTED: <rule>`` on the offending line; the
check must report exactly that (line, rule) and nothing else. Good fixtures are loops written the way the
upstream projects document them (a manual loop with the guard; nanoGPT's train.py; accelerate's
``examples/by_feature/gradient_accumulation.py``; the HF Trainer) and must produce no finding.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from vramledger.accum.script_check import RULES, check_script, check_source
from vramledger.errors import VramledgerError

FIXTURES = Path(__file__).parent / "fixtures"
BAD = sorted(FIXTURES.glob("bad_*.py"))
GOOD = sorted(FIXTURES.glob("good_*.py"))
_PLANTED = re.compile(r"#\s*PLANTED:\s*(ACC\d{3})")


def _planted(path: Path) -> list[tuple[int, str]]:
    return [
        (n, m.group(1)) for n, line in enumerate(path.read_text().splitlines(), start=1) if (m := _PLANTED.search(line))
    ]


def test_every_rule_is_planted_somewhere() -> None:
    planted = {rule for p in BAD for _, rule in _planted(p)}
    assert planted == set(RULES)


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_planted_mistake_is_found_at_its_line(path: Path) -> None:
    expected = _planted(path)
    assert len(expected) == 1, "each bad fixture plants exactly one mistake"
    report = check_script(path)
    got = [(f.line, f.rule) for f in report.findings]
    print(f"{path.name}: expected {expected}, got {got}")
    assert got == expected
    f = report.findings[0]
    assert f.message.endswith(".") and f.fix.endswith(".")
    assert report.loops, "the finding must come from a recognised accumulation loop"


# The kind of loop each good fixture holds (None: no manual accumulation loop at all).
GOOD_LOOPS = {
    "good_accelerate": "accelerate",
    "good_hf_trainer": None,
    "good_manual_guard": "guard",
    "good_nanogpt_inner_loop": "inner loop",
    "good_no_accumulation": None,
    "good_token_normalised": "inner loop",
}


@pytest.mark.parametrize("path", GOOD, ids=[p.stem for p in GOOD])
def test_correct_loops_stay_silent(path: Path) -> None:
    report = check_script(path)
    assert report.findings == (), [(f.line, f.rule) for f in report.findings]
    kinds = [lp.kind for lp in report.loops]
    assert kinds == ([GOOD_LOOPS[path.stem]] if GOOD_LOOPS[path.stem] else [])


def _check(src: str) -> list[tuple[int, str]]:
    return [(f.line, f.rule) for f in check_source(textwrap.dedent(src)).findings]


GUARDED_LOOP = """\
for step, batch in enumerate(loader):
    {pre}
    {backward}
    if (step + 1) % accum == 0:
        optimizer.step()
        {in_guard}
    {post}
"""


LOSS = "loss = model(**batch).loss"
SCALED = "loss = model(**batch).loss / accum"
BWD = "loss.backward()"
ZERO = "optimizer.zero_grad()"


@pytest.mark.parametrize(
    ("pre", "backward", "in_guard", "post", "expected"),
    [
        pytest.param(LOSS, "(loss / accum).backward()", ZERO, "", [], id="divided-inline"),
        pytest.param(LOSS, BWD, ZERO, "", [(3, "ACC002")], id="undivided"),
        pytest.param(f"{LOSS}; loss /= accum", BWD, ZERO, "", [], id="augassign"),
        pytest.param(f"{LOSS} * (1 / accum)", BWD, ZERO, "", [], id="times-reciprocal"),
        pytest.param("loss = loss_fn(model(x), y) / n_tokens", BWD, ZERO, "", [], id="token-normalised"),
        pytest.param("loss = model(**b, num_items_in_batch=n).loss", BWD, ZERO, "", [], id="num-items-in-batch"),
        pytest.param(LOSS, "torch.autograd.backward(loss)", ZERO, "", [(3, "ACC002")], id="autograd-backward"),
        pytest.param(SCALED, BWD, "pass", "model.zero_grad()", [(7, "ACC003")], id="zero-grad-after-guard"),
        pytest.param(SCALED, BWD, "pass", "lr_sched.step()", [(7, "ACC001")], id="scheduler-after-guard"),
        pytest.param(SCALED, BWD, "warmup.step()", "", [], id="scheduler-in-guard"),
        pytest.param(SCALED, BWD, "pass", "warmup.step()", [(7, "ACC001")], id="warmup-scheduler-after-guard"),
    ],
)
def test_guard_loop_variants(pre, backward, in_guard, post, expected) -> None:
    src = GUARDED_LOOP.format(pre=pre, backward=backward, in_guard=in_guard, post=post)
    if "warmup" in src:  # a scheduler recognised by its constructor, not by its name
        src = "warmup = LambdaLR(optimizer, f)\n" + src
        expected = [(line + 1, rule) for line, rule in expected]
    assert _check(src) == expected


def test_zero_grad_at_the_start_of_each_window_is_fine() -> None:
    src = """
        for step, batch in enumerate(loader):
            if step % accum == 0:
                optimizer.zero_grad()
            loss = model(**batch).loss / accum
            loss.backward()
            if (step + 1) % accum == 0:
                optimizer.step()
                scheduler.step()
    """
    assert _check(src) == []


def test_loss_scaled_inside_a_local_helper() -> None:
    src = """
        def compute_loss(model, batch, accum):
            out = model(**batch)
            return out.loss / accum

        def train(model, loader, optimizer, accum):
            for step, batch in enumerate(loader):
                loss = compute_loss(model, batch, accum)
                loss.backward()
                if (step + 1) % accum == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    """
    assert _check(src) == []


def test_while_loop_with_micro_step_counter() -> None:
    src = """
        micro = 0
        while True:
            optimizer.zero_grad()
            loss = model(next(it)).loss / accum_steps
            loss.backward()
            micro += 1
            if micro == accum_steps:
                optimizer.step()
                micro = 0
    """
    assert _check(src) == [(4, "ACC003")]


def test_accelerator_backward_scales_only_when_accelerator_accumulates() -> None:
    loop = """
        accelerator = Accelerator({args})
        for step, batch in enumerate(loader):
            accelerator.backward(model(**batch).loss)
            if (step + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
    """
    assert _check(loop.format(args="gradient_accumulation_steps=accum")) == []
    assert _check(loop.format(args="")) == [(4, "ACC002")]


def test_accelerate_unprepared_scheduler_under_sync_gradients_is_fine() -> None:
    src = """
        model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
        for batch in dl:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
    """
    assert _check(src) == []


def test_accelerate_model_zero_grad_is_flagged() -> None:
    src = """
        model, optimizer, dl, scheduler = accelerator.prepare(model, optimizer, dl, scheduler)
        for batch in dl:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                scheduler.step()
                model.zero_grad()
    """
    assert _check(src) == [(8, "ACC003")]


def test_deepspeed_engine_loop_is_not_accumulation() -> None:
    # DeepSpeed's engine.step() is called every micro-batch and accumulates internally.
    src = """
        for batch in loader:
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
    """
    assert _check(src) == []


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(VramledgerError, match=r"--script .*missing\.py: cannot read it") as exc:
        check_script(tmp_path / "missing.py")
    assert exc.value.exit_code == 2
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x80\x81\xff\x00")
    with pytest.raises(VramledgerError, match="cannot read it"):
        check_script(binary)


def test_unparsable_file(tmp_path: Path) -> None:
    bad = tmp_path / "train.py"
    bad.write_text("import torch\n\nfor batch in loader\n    loss.backward()\n")
    with pytest.raises(VramledgerError, match=r"train\.py:3: not valid Python") as exc:
        check_script(bad)
    assert exc.value.exit_code == 2
