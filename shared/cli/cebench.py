"""Typer commands for CE-Bench, SAE training and valence bias: thin shells over poolbench.prober.

Registered on the driver app as `cebench`, `sae train` and `bias`; their errors are PoolBenchErrors, which
`poolbench.cli.app.main` prints as one line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from poolbench.atomic_write import write_json_atomic
from poolbench.cli.options import out_folder
from poolbench.defaults import EMBEDDED
from poolbench.errors import PoolBenchError

console = Console()


def _document(kind: str, config: dict[str, Any], **sections: Any) -> dict[str, Any]:
    from poolbench.provenance import git_hash, package_versions, utc_now

    return {"kind": kind, "config": config, **sections, "versions": package_versions(), "git": git_hash(),
            "created": utc_now()}


def _model_info(loaded) -> dict[str, Any]:
    return {"model_id": loaded.model_id, "weights_hash": loaded.weights_hash, "n_layers": loaded.n_layers,
            "hidden_size": loaded.hidden_size, "dtype": str(loaded.dtype).removeprefix("torch.")}


def _check_layer(loaded, layer: int) -> int:
    index = layer + loaded.n_layers if layer < 0 else layer
    if not 0 <= index < loaded.n_layers:
        raise PoolBenchError(f"--layer {layer}: model '{loaded.model_id}' has {loaded.n_layers} layers "
                             f"(0..{loaded.n_layers - 1})")
    return index


def cebench(
    model: Annotated[str, typer.Option(help="HF id or local path; 'embedded' for the built-in model")] = EMBEDDED,
    layer: Annotated[int, typer.Option(help="decoder layer whose output (layers.L.out) is scored")] = -1,
    sae: Annotated[Path | None, typer.Option(help="SAE weights (.safetensors, .npz or SAELens folder)")] = None,
    data: Annotated[Path | None, typer.Option(help="CE-Bench JSONL; default: the embedded generator")] = None,
    entries: Annotated[int, typer.Option(help="entries to generate when --data is not given")] = 48,
    seed: Annotated[int, typer.Option(help="generator seed")] = 0,
    top: Annotated[int, typer.Option(help="top features to show and record")] = 10,
    out: Annotated[Path, typer.Option(help="folder for results.json")] = Path("runs/cebench"),
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda")] = "auto",
    batch_size: Annotated[int, typer.Option(help="stories per forward pass")] = 16,
    normalisation: Annotated[str, typer.Option(
        help="entry_zscore (the published CE-Bench: z across an entry's features) or dataset_minmax")]
    = "entry_zscore",
) -> None:
    """CE-Bench contrastive, independent and interpretability scores on neurons or SAE features."""
    from poolbench.cebench.data import generate_cebench, load_cebench
    from poolbench.cebench.sae import load_sae
    from poolbench.cebench.scores import NORMALISATIONS
    from poolbench.cebench.span_activations import run_cebench
    from poolbench.extractor.loading import load_model

    if normalisation not in NORMALISATIONS:
        raise PoolBenchError(f"--normalisation must be one of {', '.join(NORMALISATIONS)}, got '{normalisation}'")
    dataset = load_cebench(data) if data else generate_cebench(entries, seed=seed)
    loaded = load_model(model, dtype=dtype, device=device)
    index = _check_layer(loaded, layer)
    weights = load_sae(sae, hidden_size=loaded.hidden_size) if sae else None
    start = time.perf_counter()
    scores = run_cebench(loaded, dataset, index, sae=weights, batch_size=batch_size, normalisation=normalisation)
    seconds = time.perf_counter() - start
    unit = f"SAE features (m={weights.m})" if weights else f"neurons (d={loaded.hidden_size})"
    table = Table(title=f"CE-Bench, {loaded.model_id} layers.{index}.out, {unit}, {len(dataset)} entries")
    for column in ("score", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for name in ("contrastive", "independent", "interpretability"):
        table.add_row(name, f"{getattr(scores, name):.4f}")
    console.print(table)
    top_rows = scores.top_features(top)
    features = Table(title=f"top {len(top_rows)} features (mean over entries, {normalisation})")
    for column in ("feature", "contrastive", "independent", "interpretability", "argmax entries c/i"):
        features.add_column(column, justify="right")
    for row in top_rows:
        features.add_row(str(row["feature"]), f"{row['contrastive']:.4f}", f"{row['independent']:.4f}",
                         f"{row['interpretability']:.4f}",
                         f"{row['argmax_contrastive_entries']}/{row['argmax_independent_entries']}")
    console.print(features)
    config = {"model": model, "layer": index, "hook_point": f"layers.{index}.out",
              "sae": str(sae) if sae else None, "data": str(data) if data else f"generated:{entries}:seed={seed}",
              "normalisation": normalisation,
              "dtype": dtype, "device": device}
    target = out_folder(out) / "results.json"
    write_json_atomic(target, _document(
        "cebench", config, model=_model_info(loaded), seconds=round(seconds, 2),
        scores={"contrastive": scores.contrastive, "independent": scores.independent,
                "interpretability": scores.interpretability},
        top_features=top_rows,
        entries=[{"id": e.id, "contrastive": float(c), "contrastive_feature": int(cf), "independent": float(i),
                  "independent_feature": int(jf)}
                 for e, c, cf, i, jf in zip(dataset, scores.entry_contrastive, scores.entry_contrastive_feature,
                                            scores.entry_independent, scores.entry_independent_feature,
                                            strict=True)],
        features={"contrastive": scores.feature_contrastive.tolist(),
                  "independent": scores.feature_independent.tolist()}))
    console.print(f"wrote {target} ({seconds:.1f}s)")


def sae_train(
    out: Annotated[Path, typer.Option(help="folder for sae.safetensors (or sae.npz with --format npz)")],
    model: Annotated[str, typer.Option(help="HF id or local path; 'embedded' for the built-in model")] = EMBEDDED,
    layer: Annotated[int, typer.Option(help="decoder layer whose output the SAE reads")] = -1,
    features: Annotated[int, typer.Option(help="number of SAE features m")] = 1024,
    l1: Annotated[float, typer.Option(help="L1 sparsity coefficient (activations rescaled to mean |x|^2 = d)")]
    = 1.0,
    steps: Annotated[int, typer.Option(help="Adam steps")] = 1500,
    tokens: Annotated[int, typer.Option(help="training tokens taken from the embedded LM texts")] = 40_000,
    seed: Annotated[int, typer.Option(help="seed for initialisation and batches")] = 0,
    format_: Annotated[str, typer.Option("--format", help="safetensors or npz")] = "safetensors",
) -> None:
    """Train a small SAE on a layer's activations over the embedded LM texts (deterministic, CPU)."""
    from poolbench.cebench.sae import save_sae, train_sae
    from poolbench.cebench.span_activations import token_activations
    from poolbench.corpus.english import generated_texts
    from poolbench.extractor.loading import load_model

    if format_ not in ("safetensors", "npz"):
        raise PoolBenchError(f"--format {format_}: one of safetensors, npz")
    target = out_folder(out) / f"sae.{format_}"
    loaded = load_model(model, device="cpu", dtype="float32")
    index = _check_layer(loaded, layer)
    start = time.perf_counter()
    acts = token_activations(loaded, generated_texts(4000, seed=seed + 1), index, max_tokens=tokens)
    sae, report = train_sae(acts, features, l1=l1, steps=steps, seed=seed)
    seconds = time.perf_counter() - start
    metadata = {"model": model, "weights_hash": loaded.weights_hash, "hook_point": f"layers.{index}.out",
                "d": str(loaded.hidden_size), "m": str(features), "l1": str(l1), "steps": str(steps),
                "tokens": str(len(acts)), "seed": str(seed)}
    target.parent.mkdir(parents=True, exist_ok=True)
    save_sae(sae, target, metadata=metadata if target.suffix == ".safetensors" else None)
    console.print(f"SAE layers.{index}.out d={loaded.hidden_size} m={features}: {len(acts)} tokens, "
                  f"FVU {report.fraction_variance_unexplained:.3f}, mean L0 {report.mean_l0:.1f}, "
                  f"{report.dead_features} dead, {seconds:.0f}s -> {target}")


def _load_lists(domain: Path | None, positive: Path | None, negative: Path | None):
    from poolbench.corpus.word_lists import DEFAULT_DOMAIN, DEFAULT_NEGATIVE, DEFAULT_POSITIVE, load_word_list

    return (load_word_list(domain, DEFAULT_DOMAIN), load_word_list(positive, DEFAULT_POSITIVE),
            load_word_list(negative, DEFAULT_NEGATIVE))


def _bias_table(title: str, result, words) -> Table:
    import numpy as np

    table = Table(title=title)
    for column in ("score", "value", "95% CI" if result.confidence == 0.95 else "CI", "excludes 0"):
        table.add_column(column, justify="left" if column == "score" else "right")
    for name, interval in (("ΔValence", result.delta_valence), ("ΔVar", result.delta_var)):
        table.add_row(name, f"{interval.value:+.3e}", f"[{interval.ci_low:+.3e}, {interval.ci_high:+.3e}]",
                      "yes" if interval.excludes_zero else "no")
    movers = np.argsort(-np.abs(result.shift), kind="stable")[:3]
    table.caption = "largest valence shifts: " + ", ".join(
        f"{words.words[i]} {result.shift[i]:+.2e}" for i in movers)
    return table


def _bias_json(result, words) -> dict[str, Any]:
    return {"delta_valence": result.delta_valence.to_json(), "delta_var": result.delta_var.to_json(),
            "words": {w: {"before": float(b), "after": float(a)}
                      for w, b, a in zip(words.words, result.valence_before, result.valence_after, strict=True)}}


def _favourite_json(result, words, favourite: str) -> dict[str, Any]:
    """How the praised word moved: its Δvalence and its rank among the domain's movers (1 = top)."""
    import numpy as np

    from poolbench.valence.bias import mover_rank

    if favourite not in words.words:
        return {"word": favourite, "in_domain": False}
    index = words.words.index(favourite)
    by_rise, by_size = mover_rank(result.shift, index)
    top = int(np.argmax(result.shift))
    return {"word": favourite, "in_domain": True, "delta": float(result.shift[index]), "rank_by_rise": by_rise,
            "rank_by_size": by_size, "top_riser": words.words[top], "top_riser_delta": float(result.shift[top])}


def bias(
    before: Annotated[str | None, typer.Option(help="the first checkpoint (HF id or local path)")] = None,
    after: Annotated[str | None, typer.Option(help="the second checkpoint")] = None,
    domain: Annotated[Path | None, typer.Option(help="domain words, one a line; default: furniture")] = None,
    positive: Annotated[Path | None, typer.Option(help="positive-emotion words; default shipped list")] = None,
    negative: Annotated[Path | None, typer.Option(help="negative-emotion words; default shipped list")] = None,
    layer: Annotated[str, typer.Option(help="'final' (last layer through the final norm) or an index")] = "final",
    centre: Annotated[bool, typer.Option(help="subtract the words' mean representation before cosines")] = False,
    pooling: Annotated[str, typer.Option(help="'word_mean' (the word's tokens) or a strategy id")] = "word_mean",
    template: Annotated[str, typer.Option(help="text a word is read in; must contain {word}")] = "{word}",
    n_bootstrap: Annotated[int, typer.Option(help="bootstrap resamples over domain words")] = 2000,
    seed: Annotated[int, typer.Option(help="bootstrap seed (and fine-tune seed with --demo)")] = 0,
    demo: Annotated[bool, typer.Option(help="fine-tune --before (default: embedded) on praise vs generic text, "
                                             "read with the demo's own layer, centring and template")] = False,
    store: Annotated[str | None, typer.Option(help="artifact store for the demo's cached fine-tunes "
                                                   "(folder or s3://); default ~/.cache/poolbench/store")] = None,
    out: Annotated[Path, typer.Option(help="folder for results.json")] = Path("runs/bias"),
) -> None:
    """Valence bias between two checkpoints: ΔValence and ΔVar over domain words with bootstrap CIs."""
    from poolbench.valence.run import bias_between, demo_settings, run_demo

    lists = _load_lists(domain, positive, negative)
    try:
        options = {"layer": layer if layer == "final" else int(layer), "pooling": pooling, "template": template,
                   "centre": centre}
    except ValueError:
        raise PoolBenchError(f"--layer {layer!r}: expected 'final' or an integer") from None
    config = {"domain": lists[0].source, "positive": lists[1].source, "negative": lists[2].source, **options,
              "bootstrap": n_bootstrap, "seed": seed, "variance": "population (ddof=0)",
              "ci": "paired percentile bootstrap over domain words, 95%"}
    start = time.perf_counter()
    if demo:
        if after:
            raise PoolBenchError("--demo makes its own 'after' checkpoints; drop --after (--before picks the base)")
        from poolbench.store.url import open_store

        settings = demo_settings(before, seed)
        outcome = run_demo(lists, settings, n_bootstrap=n_bootstrap, store=open_store(store))
        config.update(layer=settings.layer, template=settings.template, centre=settings.centre,
                      pooling=settings.pooling)
        for name in ("praise", "control"):
            console.print(_bias_table(f"{name} fine-tune: {outcome.texts[name][0]!r} ...", outcome.results[name],
                                      lists[0]))
            fav = _favourite_json(outcome.results[name], lists[0], settings.favourite)
            if fav["in_domain"]:
                console.print(f"{fav['word']}: Δvalence {fav['delta']:+.3e}, rank {fav['rank_by_rise']} of "
                              f"{len(lists[0].words)} by rise (top riser {fav['top_riser']} "
                              f"{fav['top_riser_delta']:+.3e})")
        document = _document("bias-demo", {**config, "demo": outcome.settings_json()},
                             model=_model_info(outcome.base), seconds=round(time.perf_counter() - start, 2),
                             fine_tunes=outcome.fine_tunes_json(),
                             results={k: {**_bias_json(v, lists[0]),
                                          "favourite": _favourite_json(v, lists[0], settings.favourite)}
                                      for k, v in outcome.results.items()})
    else:
        if not before or not after:
            raise PoolBenchError("bias needs --before and --after (or --demo)")
        result, infos = bias_between(before, after, lists, n_bootstrap=n_bootstrap, seed=seed, **options)
        console.print(_bias_table(f"valence bias {before} -> {after}", result, lists[0]))
        document = _document("bias", {**config, "before": before, "after": after},
                             models={"before": infos[0], "after": infos[1]},
                             seconds=round(time.perf_counter() - start, 2), results=_bias_json(result, lists[0]))
    target = out_folder(out) / "results.json"
    write_json_atomic(target, document)
    console.print(f"wrote {target} ({time.perf_counter() - start:.1f}s)")
