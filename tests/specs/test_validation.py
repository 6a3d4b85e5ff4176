"""TrainSpec as Python users write it: strings accepted where an Enum is expected, validated with the choices."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramledger.errors import VramledgerError
from vramledger.specs import Attention, LoraSpec, Method, Optimizer, Precision, QuantSpec, TrainSpec, check_headroom


def test_strings_name_the_enum_members() -> None:
    t = TrainSpec(method="qlora", precision="bf16-mixed", optimizer="paged_adamw_8bit", attn="SDPA")
    assert t.method is Method.QLORA and t.precision is Precision.BF16_MIXED
    assert t.optimizer is Optimizer.PAGED_ADAMW_8BIT and t.attn is Attention.SDPA
    assert t.quant == QuantSpec()  # QLoRA's default base, as with the Enum
    assert t == TrainSpec(method=Method.QLORA, precision=Precision.BF16_MIXED, optimizer=Optimizer.PAGED_ADAMW_8BIT)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "lorra"}, "TrainSpec method: unknown value 'lorra'; choose one of 'full', 'freeze', 'lora'"),
        ({"optimizer": 3}, "TrainSpec optimizer: expected a Optimizer or its name"),
        ({"micro_batch": 2.5}, "micro_batch must be an integer"),
        ({"sgd_momentum": math.nan}, "SGD momentum must be in"),
        ({"sgd_momentum": -1.0}, "SGD momentum must be in"),
    ],
)
def test_bad_values_are_one_clear_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(VramledgerError, match=message):
        TrainSpec(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -1.0])
def test_lora_alpha_must_be_finite(alpha: float) -> None:
    with pytest.raises(VramledgerError, match="lora alpha must be a finite number"):
        LoraSpec(alpha=alpha)


def test_lora_targets_as_a_comma_separated_string() -> None:
    assert LoraSpec(targets="q_proj, v_proj").targets == ("q_proj", "v_proj")


@pytest.mark.parametrize("value", [math.nan, -0.1, 1.0, True, "0.1"])
def test_headroom_is_a_fraction(value: object) -> None:
    with pytest.raises(VramledgerError, match=r"--headroom must be a fraction in \[0, 1\)"):
        check_headroom(value)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    method=st.sampled_from(list(Method)),
    precision=st.sampled_from(list(Precision)),
    grad_ckpt=st.booleans(),
    world_size=st.integers(1, 16),
    batch=st.integers(1, 64),
    length=st.integers(1, 1 << 17),
)
def test_at_shape_is_replace_without_the_checks(
    method: Method, precision: Precision, grad_ckpt: bool, world_size: int, batch: int, length: int
) -> None:
    """``at_shape`` skips ``__post_init__`` for speed; what it makes must be the spec ``dataclasses.replace`` makes
    (equal, same hash, the defaults __post_init__ fills in kept), or the reserve's searches would price another
    setup."""
    t = TrainSpec(method=method, precision=precision, grad_ckpt=grad_ckpt, world_size=world_size)
    fast, checked = t.at_shape(batch, length), dataclasses.replace(t, micro_batch=batch, seq_len=length)
    assert fast == checked and hash(fast) == hash(checked) and fast.tokens == batch * length
    assert fast.quant == checked.quant and fast.lora == checked.lora


def test_at_shape_refuses_an_empty_shape() -> None:
    with pytest.raises(VramledgerError, match="positive batch and length"):
        TrainSpec().at_shape(0, 128)
