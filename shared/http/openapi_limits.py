"""The deployment's runtime limits in its OpenAPI document: in words in the description and as JSON-schema
keywords on the request fields, so a client can read what will be refused."""

from __future__ import annotations

from poolbench.http.settings import ServiceSettings


def limits_description(settings: ServiceSettings) -> str:
    """Every limit of this deployment, in words, for the OpenAPI description."""
    return (
        "Pooling, D1 probes, classifier B and steering.\n\n"
        "Limits of this deployment:\n"
        f"- request body: at most {settings.max_body_bytes} bytes, counted while it streams (chunked bodies too); "
        "over it: 413\n"
        f"- texts / items / prompts: at most {settings.max_texts} per request, each at most {settings.max_chars} "
        "characters; over it: 422\n"
        f"- /generate max_new_tokens: at most {settings.max_new_tokens}; vector: the model's hidden size; "
        f"stored vectors of the run for: {', '.join(sorted(settings.pooled_keys)) or 'none'} (others: 404)\n"
        f"- /probe n_bootstrap: at most {settings.max_bootstrap}; n_folds 2 to 10\n"
        "- every number must be finite: NaN and Infinity are refused with 422\n"
        f"- models: {', '.join(settings.models) or 'none'} (others: 404); "
        f"scorers: {', '.join(settings.scorer_concepts) or 'none'} (others: 404)\n"
        f"- per replica at most {settings.max_working} requests at once (waiting requests of one endpoint run as one "
        f"batch of up to {settings.batch_size}) and {settings.max_queued} queued; beyond that: 503 with Retry-After "
        "(seconds)")


def schema_limits(settings: ServiceSettings) -> dict[str, dict[str, dict]]:
    """The runtime limits as JSON-schema keywords on the request models' fields."""
    texts = {"maxItems": settings.max_texts, "items": {"maxLength": settings.max_chars}}
    return {"PoolRequest": {"texts": texts}, "ScoreRequest": {"texts": texts},
            "GenerateRequest": {"prompts": texts, "max_new_tokens": {"maximum": settings.max_new_tokens}},
            "ProbeRequest": {"items": {"maxItems": settings.max_texts},
                             "n_bootstrap": {"maximum": settings.max_bootstrap}},
            "LabelledText": {"text": {"maxLength": settings.max_chars}}}


def merge_keywords(target: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_keywords(target[key], value)
        else:
            target[key] = value
