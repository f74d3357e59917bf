"""Fixtures for the routing tests: a tiny word-level tokenizer and a tiny random Llama (built by routing_testutil)."""

from __future__ import annotations

import pytest
import routing_testutil


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return routing_testutil.tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tiny_tokenizer):
    return routing_testutil.tiny_llama(tiny_tokenizer)
