"""Skip the trace tests when the trace extra (torch, transformers, peft) is missing."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
