"""Fixtures shared by the local vLLM pair tests (tests/test_local_*.py)."""
from __future__ import annotations

import pytest

from kvtune.local.reference import standard_reference
from kvtune.local.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny local model, built once per test session (cached under the session's basetemp)."""
    return make_tiny_model(tmp_path_factory.getbasetemp() / "kvtune-local-model")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir):
    """Single-instance outputs of the standard prompts and conversations (cached on disk)."""
    return standard_reference(tmp_path_factory.getbasetemp() / "kvtune-local-reference",
                              model_dir=model_dir)
