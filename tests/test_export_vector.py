"""`export-vector`: a run's steering vector as a llama.cpp control-vector GGUF, a safetensors layer map and a torch
file, read back by other projects' own readers: repeng's ControlModel steers the same tiny Llama to the same greedy
continuation as PoolBench's transformers backend at the same alpha; gguf's GGUFReader, safetensors and
torch.load(weights_only=True) read the values and provenance; what a format cannot hold is one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from planted_run import PLANTED, D, store_planted_table
from tolerances import assert_float32_close
from typer.testing import CliRunner

from poolbench.results.exports.vector_export import ExportError, exported_vector
from poolbench.results.exports.vector_formats import write_vector

RESIDUAL_NORM = 6.0
EXPECTED = np.array([3.6, -4.8] + [0.0] * (D - 2))  # RESIDUAL_NORM x (0.6, -0.8, 0, ...), by hand
PROMPTS = ["the cat sat on", "birds sang in the trees near the river"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, layered_llama_dir) -> Path:
    """A run folder as `poolbench-driver run` leaves it, as far as export reads it: config.store, model and corpus
    provenance, the pooled table's key (A1_mean at layers 0 and 1, planted so the train DiffMean is PLANTED) and a
    D2 cell (steered at layer 1: residual norm, alpha*, fluency guard)."""
    root = tmp_path_factory.mktemp("run")
    store_planted_table(root / "store", layers=(0, 1))
    out = root / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({
        "date": "2026-11-25T00:00:00Z", "git_hash": "abc123",
        "config": {"store": str(root / "store"), "model": str(layered_llama_dir), "model_args": {"revision": "r1"}},
        "model": {"model_id": str(layered_llama_dir), "weights_hash": "w" * 64, "n_layers": 2, "hidden_size": D},
        "corpus": {"source": "embedded", "hash": "c0ffee"},
        "artifacts": {"praise": {"pooled": "pooled/praise"}},
        "d2": [{"concept": "praise", "strategy": "A1_mean", "layer": 1, "residual_norm": RESIDUAL_NORM,
                "alpha_star": 1.5, "alpha_star_outcome": "chosen", "fluency_guard": 2.0, "fluency_ratio": 1.3,
                "d2_delta": 0.25, "backend": "transformers"}]}))
    return out


def test_gguf_holds_the_alpha_one_vector_at_direction_layer_with_provenance(run, tmp_path, layered_llama_dir):
    from gguf import GGUFReader

    path = write_vector(exported_vector(run, "praise", "A1"), "gguf", tmp_path)  # layer: the steered cell's, 1
    assert path == tmp_path / "praise-A1_mean-L1.gguf"
    reader = GGUFReader(path)

    def field(name):
        f = reader.get_field(name)
        assert f is not None, name
        return f.contents()

    assert field("general.architecture") == "controlvector"
    assert field("controlvector.model_hint") == str(layered_llama_dir)
    assert field("controlvector.layer_count") == 1
    assert [t.name for t in reader.tensors] == ["direction.1"]
    assert_float32_close(np.asarray(reader.tensors[0].data), EXPECTED)
    assert field("poolbench.residual_norm") == RESIDUAL_NORM and field("poolbench.alpha_star") == 1.5
    assert field("poolbench.fluency_guard") == 2.0 and field("poolbench.unit") == "residual"
    assert field("poolbench.hook_point") == "layers.1.out" and field("poolbench.strategy") == "A1_mean"
    assert field("poolbench.model_weights_hash") == "w" * 64 and field("poolbench.model_revision") == "r1"
    assert field("poolbench.corpus_hash") == "c0ffee" and field("poolbench.steered") == 1


def test_repeng_control_model_on_the_gguf_gives_poolbench_s_greedy_continuation(run, tmp_path, layered_llama_dir,
                                                                               monkeypatch):
    """The real client: repeng 0.4.0 imports the GGUF and its ControlModel adds coeff x direction.1 to block 1's
    output; at coeff = alpha that is PoolBench's transformers backend steering at layer 1 with D2's delta(alpha)."""
    # repeng 0.4.0 names np.float_ (gone in NumPy 2) in a signature: the alias NumPy 1 had, while it is imported
    monkeypatch.setattr(np, "float_", np.float64, raising=False)
    from repeng import ControlModel, ControlVector
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from poolbench.extractor.loading import load_model
    from poolbench.steerer.backend import GenerationSettings
    from poolbench.steerer.transformers_backend import TransformersBackend
    from poolbench.steerer.vector import SteeringVector

    alpha, new = 1.5, 8
    path = write_vector(exported_vector(run, "praise", "A1_mean", 1), "gguf", tmp_path / "v.gguf")
    control = ControlVector.import_gguf(str(path))
    assert sorted(control.directions) == [1]
    tok = AutoTokenizer.from_pretrained(layered_llama_dir)
    controlled = ControlModel(AutoModelForCausalLM.from_pretrained(layered_llama_dir).eval(), [1])

    def repeng(coeff: float) -> list[list[int]]:
        controlled.set_control(control, coeff=coeff)
        out = []
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt")
            with torch.no_grad():
                gen = controlled.generate(**ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                          pad_token_id=tok.pad_token_id)
            out.append(gen[0, ids["input_ids"].shape[1]:].tolist())
        return out

    unit = PLANTED / np.linalg.norm(PLANTED)
    vector = SteeringVector("praise", "A1_mean", 1, unit, 5.0, RESIDUAL_NORM)
    backend = TransformersBackend(load_model(str(layered_llama_dir), device="cpu"))
    settings = GenerationSettings(max_new_tokens=new, greedy=True)

    def poolbench(a: float) -> list[list[int]]:
        gens = backend.generate(PROMPTS, layer=1, delta=vector.delta(a) if a else None, seeds=[0, 1],
                                settings=settings, prompt_format="plain")
        return [list(g.token_ids) for g in gens]

    steered = repeng(alpha)
    assert steered == poolbench(alpha)
    assert repeng(0.0) == poolbench(0.0)
    assert steered != poolbench(0.0)  # the vector does steer, so the equality above could fail


def test_safetensors_and_pt_hold_a_layer_map_and_the_metadata(run, tmp_path):
    from safetensors import safe_open

    vec = exported_vector(run, "praise", "A1_mean", 1)
    st = write_vector(vec, "safetensors", tmp_path / "v.safetensors")
    with safe_open(str(st), framework="np") as f:
        assert list(f.keys()) == ["1"]
        assert_float32_close(f.get_tensor("1"), EXPECTED)
        meta = f.metadata()
    assert meta["hook_point"] == "layers.1.out" and json.loads(meta["residual_norm"]) == RESIDUAL_NORM
    assert meta["corpus_hash"] == "c0ffee" and json.loads(meta["alpha_star"]) == 1.5
    pt = torch.load(write_vector(vec, "pt", tmp_path / "v.pt"), weights_only=True)
    assert list(pt["layer_activations"]) == [1]
    assert_float32_close(pt["layer_activations"][1].numpy(), EXPECTED)
    assert pt["metadata"]["model_weights_hash"] == "w" * 64 and pt["metadata"]["unit"] == "residual"


def test_raw_unit_is_the_diffmean_and_an_unsteered_layer_has_no_steering_metadata(run, tmp_path):
    vec = exported_vector(run, "praise", "A1_mean", 0, unit="raw")
    assert_float32_close(vec.vector, PLANTED)  # |DiffMean| = 5 at its own length
    assert vec.metadata["steered"] == 0 and "alpha_star" not in vec.metadata and "residual_norm" not in vec.metadata
    with pytest.raises(ExportError, match=r"^--unit residual: .* no residual norm for 'praise' at layer 0"):
        exported_vector(run, "praise", "A1_mean", 0)


def test_what_a_format_cannot_hold_or_a_run_does_not_have_is_one_line(run, tmp_path):
    layer0 = exported_vector(run, "praise", "A1_mean", 0, unit="raw")
    with pytest.raises(ExportError, match=r"^--format gguf: layer 0 cannot be addressed; llama.cpp control"):
        write_vector(layer0, "gguf", tmp_path)
    assert not list(tmp_path.iterdir())
    write_vector(layer0, "safetensors", tmp_path)  # a layer map holds layer 0
    doc = json.loads((run / "results.json").read_text())
    doc["d2"][0]["site"] = "attn"
    attn_run = tmp_path / "attn"
    attn_run.mkdir()
    (attn_run / "results.json").write_text(json.dumps(doc))
    attn = exported_vector(attn_run, "praise", "A1_mean", 1)
    assert attn.hook_point == "layers.1.attn"
    for fmt in ("gguf", "safetensors"):
        with pytest.raises(ExportError, match=rf"^--format {fmt}: the vector is at site 'attn' \(layers.1.attn\)"):
            write_vector(attn, fmt, tmp_path)
    with pytest.raises(ExportError, match=r"^--concept: .* no pooled table for 'joy' \(run concepts: praise\)$"):
        exported_vector(run, "joy", "A1_mean", 1)
    with pytest.raises(ExportError, match=r"^--layer: .* pooled 'praise' at layers 0, 1, not 5$"):
        exported_vector(run, "praise", "A1_mean", 5, unit="raw")
    with pytest.raises(ExportError, match=r"^--layer: .* steered praise/P1_last at no layer; name one with --layer"):
        exported_vector(run, "praise", "P1_last")
    with pytest.raises(ExportError, match="no such file"):
        exported_vector(tmp_path / "nowhere", "praise", "A1_mean", 1)


def test_cli_writes_the_file_and_refuses_in_one_line(run, tmp_path):
    from poolbench.cli.app import app

    ok = CliRunner().invoke(app, ["export-vector", "--run", str(run), "--concept", "praise", "--strategy",
                                  "A1_mean", "--format", "safetensors", "--out", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "praise-A1_mean-L1.safetensors").is_file() and "layers.1.out" in ok.output
    bad = CliRunner().invoke(app, ["export-vector", "--run", str(run), "--concept", "praise", "--strategy",
                                   "A1_mean", "--layer", "0", "--unit", "raw", "--out", str(tmp_path)])
    assert bad.exit_code != 0
    assert isinstance(bad.exception, ExportError) and str(bad.exception).startswith("--format gguf: layer 0")
