"""A chunk's launch never reads the device: S2's log-likelihood terms come from the batch's host mask and the
attention capture's mask check is read when the chunk is finished. A read inside the launch holds the host until the
device has run everything enqueued before it; the later-key check at the end of the launch (session 39) held it until
the chunk's forward, backward and pooling were done, so the host's work between chunks ran with the device idle.
The one read left is transformers' own, at the start of the forward (whether a padding mask may be skipped), which
waits for the chunk before: the host has nothing else to enqueue then, and the forward's kernels follow at once.

On CPU the reads are counted as the aten ops that bring a device value to the host (torch's dispatch mode); on CUDA
the launch runs under torch's sync debug mode set to raise."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from device_reads import DeviceReads
from transformers import masking_utils

from poolbench.corpus.source import open_corpus
from poolbench.extractor import attention_capture, capture
from poolbench.extractor.attention_capture import AttentionCaptureError, LaterKeyCheck
from poolbench.extractor.lm_head_likelihood import real_pairs, real_pairs_from_host
from poolbench.extractor.loading import load_model
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.registry import list_strategies

STRATEGIES = ("P1_last", "A1_mean", "A2_max", "S1_attention", "S2_gradient", "S3_iti_probe")


def launches_counted(monkeypatch: pytest.MonkeyPatch, launches: list[DeviceReads],
                     around: Callable[[Callable[[], object]], object] | None = None) -> None:
    """capture._launch_chunk counted: one DeviceReads a launch, appended to `launches`."""
    original = capture._launch_chunk

    def counted(*args, **kwargs):
        with DeviceReads() as reads:
            launched = original(*args, **kwargs) if around is None else around(lambda: original(*args, **kwargs))
        launches.append(reads)
        return launched

    monkeypatch.setattr(capture, "_launch_chunk", counted)


def pool_hedging(model_dir, device: str = "cpu", passages: int = 12):
    loaded = load_model(str(model_dir), device=device)
    data = open_corpus("embedded", "tiny", ["hedging"]).passages("hedging", "train")[:passages]
    specs = [s for s in list_strategies() if s.id in STRATEGIES]
    assert len(specs) == len(STRATEGIES)
    return pool_concept_tables(loaded, data, [0, 1], specs, batch_size=4, max_length=512, overlap=True)


def vectors(pooled) -> np.ndarray:
    """Every pooled vector of a PooledConcept, [rows, d], in its tables' order."""
    return np.stack(pooled.pooled.column("vector").to_numpy(zero_copy_only=False))


def test_a_launch_reads_the_device_only_in_transformers_mask_check(tiny_llama_dir, monkeypatch) -> None:
    """With S1-S3 (attention capture, S2's backward and the device pooling) every read inside a launch is
    transformers' padding-mask check; with that check answered from the host (it says "materialise the mask" for a
    padded batch either way) a launch reads nothing. Restoring the later-key read at the capture's exit, or S2's
    device nonzero, fails both."""
    launches: list[DeviceReads] = []
    launches_counted(monkeypatch, launches)
    plain = pool_hedging(tiny_llama_dir)
    n_launches = len(launches)
    assert n_launches >= 2 and all(launch.ops > 100 for launch in launches)
    reads = [read for launch in launches for read in launch.reads]
    assert reads and {file.rsplit("/", 1)[-1] for _, file in reads} == {"masking_utils.py"}, reads

    launches.clear()
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    strict = pool_hedging(tiny_llama_dir)
    assert len(launches) == n_launches and all(launch.reads == [] for launch in launches)
    np.testing.assert_array_equal(vectors(strict), vectors(plain))  # the mask check's answer changes nothing


@pytest.mark.parametrize("seed", range(4))
def test_host_pairs_are_the_device_pairs_in_their_order(seed: int) -> None:
    """real_pairs_from_host gives real_pairs' rows and positions, in the same order: left and right padding, a row
    of one real token, a row of none."""
    rng = np.random.default_rng(seed)
    rows, length = 6, 9
    lengths = rng.integers(0, length + 1, rows)
    lengths[:2] = (1, 0)
    mask = np.arange(length)[None, :] < lengths[:, None]
    if seed % 2:
        mask = mask[:, ::-1].copy()  # left padded
    host = real_pairs_from_host(mask.astype(np.int64), torch.device("cpu"))
    device = real_pairs(torch.from_numpy(mask))
    for mine, theirs in zip(host, device, strict=True):
        assert mine.dtype == theirs.dtype == torch.int64
        assert torch.equal(mine, theirs)
    assert len(host[0]) == int(np.maximum(lengths - 1, 0).sum())


def test_the_later_key_check_waits_for_the_finish(monkeypatch) -> None:
    """Given a list, capture_attention leaves its mask check there instead of reading it at its exit; the check
    then stops naming the first layer whose mask opened a later key, and passes where none did."""
    passing = LaterKeyCheck("M", [(1, torch.tensor(False)), (2, torch.tensor(False))])
    passing()
    failing = LaterKeyCheck("M", [(1, torch.tensor(False)), (2, torch.tensor(True))])
    with pytest.raises(AttentionCaptureError, match=r"layer 2: M's causal attention"):
        failing()


def test_a_capture_stops_at_the_chunk_whose_mask_opened_a_later_key(tiny_llama_dir, monkeypatch) -> None:
    """The deferred check still stops the capture, with the layer named, before the chunk's vectors come out."""
    monkeypatch.setattr(attention_capture, "later_keys_allowed", lambda mask, *args: torch.ones((), dtype=torch.bool))
    with pytest.raises(AttentionCaptureError, match=r"layer 0: .*later key"):
        pool_hedging(tiny_llama_dir)


def test_a_chunks_mask_check_runs_after_the_next_chunk_is_enqueued(tiny_llama_dir, monkeypatch) -> None:
    """With overlap, chunk k's later-key check runs when chunk k is finished, which is after chunk k+1's launch: the
    host reads nothing of chunk k before chunk k+1 is on the device. Checking at the launch's end (before) would
    put each check before the next launch."""
    order: list[str] = []
    original_check, original_launch = attention_capture.LaterKeyCheck.__call__, capture._launch_chunk

    def check(self) -> None:
        order.append("check")
        original_check(self)

    def launch(*args, **kwargs):
        launched = original_launch(*args, **kwargs)
        order.append("launch")
        return launched

    monkeypatch.setattr(attention_capture.LaterKeyCheck, "__call__", check)
    monkeypatch.setattr(capture, "_launch_chunk", launch)
    pool_hedging(tiny_llama_dir)
    n = order.count("launch")
    assert n >= 2 and order.count("check") == n
    assert order == ["launch"] + ["launch", "check"] * (n - 1) + ["check"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_launch_never_waits_for_the_device(tiny_llama_dir, monkeypatch) -> None:
    """Each launch of a capture with S1-S3 on CUDA under the sync debug mode set to raise, transformers' padding-mask
    check answered from the host as in the CPU test: no launch synchronises (a blocking copy to the device, as
    GradientTee's mask was, raises too); the vectors of the forward's strategies are those of the same capture run
    first without the mode, bit for bit. That first run also makes the process's one-off device checks (the inflow
    kernel's against the chunked path, for each mask form it meets), which read the device by design. S2's vectors
    go through sdpa's memory-efficient backward, whose sums over queries are atomic adds in no fixed order on CUDA:
    they are only checked to be there and finite."""
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    plain = pool_hedging(tiny_llama_dir, "cuda")

    def raising(launch: Callable[[], object]) -> object:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    launches: list[DeviceReads] = []
    launches_counted(monkeypatch, launches, around=raising)
    strict = pool_hedging(tiny_llama_dir, "cuda")
    assert launches and all(launch.reads == [] for launch in launches)
    forward_only = np.asarray(plain.pooled.column("strategy").to_pylist()) != "S2_gradient"
    assert plain.pooled.column("strategy").to_pylist() == strict.pooled.column("strategy").to_pylist()
    np.testing.assert_array_equal(vectors(strict)[forward_only], vectors(plain)[forward_only])
    assert np.isfinite(vectors(strict)[~forward_only]).all() and (~forward_only).any()
