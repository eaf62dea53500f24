"""Activation sites (residual, attn, mlp) through named hook points on an HF Llama and on the same model read back
from a GGUF file: for a pre-norm block the block's output is its input plus the attention and MLP sub-blocks'
outputs, which pins each site to the right tensor (a hook on the wrong module breaks the sum by O(1)).

Tolerance: the sum is three float32 terms of the residual's magnitude (tests/tolerances.py, terms=3)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tied_gqa_llama, tiny_tokenizer, write_tiny_gguf
from tolerances import assert_float32_close

from poolbench.extractor.hook_points import HookPointError
from poolbench.extractor.loading import load_model
from poolbench.extractor.site_hooks import capture_sites, parse_site_hook_point, site_hook_point_name


def _sites_add_up(model: torch.nn.Module, decoder_layers, ids: torch.Tensor) -> None:
    got: dict[tuple[int, str], torch.Tensor] = {}
    layers = list(range(len(decoder_layers)))
    with torch.no_grad(), capture_sites(decoder_layers, layers, ["residual", "attn", "mlp"],
                                        lambda layer, site, h: got.__setitem__((layer, site), h.clone())):
        out = model(input_ids=ids, output_hidden_states=True)
    for layer in layers:
        before = out.hidden_states[layer]
        total = before + got[(layer, "attn")] + got[(layer, "mlp")]
        scale = float(max(before.abs().max(), got[(layer, "residual")].abs().max()))
        assert_float32_close(got[(layer, "residual")], total, terms=3, scale=scale, err_msg=f"layer {layer}")
        assert float((got[(layer, "attn")] - got[(layer, "mlp")]).abs().max()) > 1e-3  # two different tensors


def test_block_output_is_input_plus_attention_plus_mlp_on_hf_and_gguf(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path / "cache"))
    tokenizer = tiny_tokenizer()
    model = tied_gqa_llama(tokenizer).eval()
    ids = torch.tensor([tokenizer("The kids ran home after the long game.")["input_ids"]])
    _sites_add_up(model, model.model.layers, ids)
    loaded = load_model(str(write_tiny_gguf(tmp_path / "tiny.F32.gguf", model, tokenizer)))
    _sites_add_up(loaded.model, loaded.decoder_layers, ids)


def test_site_hook_point_names_and_bad_sites_are_one_line() -> None:
    assert site_hook_point_name(3, "attn") == "layers.3.attn"
    assert parse_site_hook_point("layers.3.mlp", 4) == (3, "mlp")
    assert parse_site_hook_point("layers.1.out", 4) == (1, "residual")
    with pytest.raises(HookPointError, match=r"expected 'layers\.<L>\.<site>'"):
        parse_site_hook_point("layers.1.ffn", 4)
    with pytest.raises(HookPointError, match="out of range"):
        parse_site_hook_point("layers.4.attn", 4)
    with pytest.raises(HookPointError, match=r"sites \['ffn'\]"), \
            capture_sites([torch.nn.Linear(2, 2)], [0], ["ffn"], lambda *a: None):
        pass
    with pytest.raises(HookPointError, match=r"layer 0: the block \(Linear\) has no attn sub-block"), \
            capture_sites([torch.nn.Linear(2, 2)], [0], ["attn"], lambda *a: None):
        pass
