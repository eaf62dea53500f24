"""Hooks are request-local: while one thread holds a capture (with its early stop) or a steering hook open on a
shared model, another thread's forward runs untouched, and the first thread's capture never sees it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from poolbench.extractor.hook_points import add_hooks, capture_layer_outputs


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    inputs = AutoTokenizer.from_pretrained(tiny_llama_dir)(["the cat sat on the mat"], return_tensors="pt")
    return model, inputs


def _while_open(opener: Callable[[], object], other: Callable[[], object]) -> object:
    """Run `other` in this thread while a second thread sits inside `opener()`'s with-block."""
    entered, done = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def hold() -> None:
        try:
            with opener():
                entered.set()
                done.wait(30)
        except BaseException as exc:  # surfaced below: the holder must not fail either
            failure.append(exc)
            entered.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert entered.wait(30)
    try:
        return other()
    finally:
        done.set()
        holder.join(30)
        assert not failure, failure


def test_another_threads_early_stopping_capture_neither_stops_nor_records_this_forward(llama):
    model, inputs = llama
    with torch.no_grad():
        alone = model(**inputs).logits
    held: dict = {}

    @contextmanager
    def recording() -> Iterator[None]:
        with capture_layer_outputs(model.model.layers, [0], stop_early=True) as captured:
            held["captured"] = captured
            yield

    with torch.no_grad():
        logits = _while_open(recording, lambda: model(**inputs).logits)
    assert torch.equal(logits, alone)
    assert held["captured"] == {}


def test_another_threads_steering_hook_leaves_this_forward_alone(llama):
    model, inputs = llama
    blocks = model.model.layers
    with torch.no_grad(), capture_layer_outputs(blocks, [1], stop_early=False) as alone:
        model(**inputs)

    def steered_elsewhere():
        with torch.no_grad(), capture_layer_outputs(blocks, [1], stop_early=False) as seen:
            model(**inputs)
        return seen

    seen = _while_open(lambda: add_hooks(blocks, {"layers.0.out": lambda h: h + 100.0}), steered_elsewhere)
    assert torch.equal(seen[1], alone[1])
    with torch.no_grad(), add_hooks(blocks, {"layers.0.out": lambda h: h + 100.0}), \
            capture_layer_outputs(blocks, [1], stop_early=False) as steered_here:
        model(**inputs)
    assert (steered_here[1] - alone[1]).abs().max() > 1.0  # the same hook does act on its own thread's forward
