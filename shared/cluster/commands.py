"""`poolbench-driver cluster up|down` (also `python -m poolbench.cluster`): thin Typer shells over the launcher."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from poolbench.cluster.launcher import LOOPBACK, STATE_DIR, cluster_down, cluster_up

cluster_app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                          help="A contained local cluster: our own Ray head, the HTTP app, S3.")

State = Annotated[Path, typer.Option(help="the cluster folder: pid records, logs, token, cluster.json")]


@cluster_app.command("up")
def up(
    ray_port: Annotated[int, typer.Option(help="port of our Ray head (GCS); its side servers take free ports")] = 6379,
    ray_host: Annotated[str, typer.Option(
        help="Ray's node IP; Ray listens on 127.0.0.1 only while this is 127.0.0.1, on every interface otherwise")]
    = LOOPBACK,
    serve_port: Annotated[int, typer.Option(help="port of the HTTP app (Serve's proxy)")] = 8000,
    host: Annotated[str, typer.Option(help="where the HTTP app listens (loopback unless you say so)")] = LOOPBACK,
    s3_port: Annotated[int, typer.Option(help="port of the local S3 server (with an s3:// --store)")] = 9000,
    store: Annotated[str | None, typer.Option(
        help="s3://bucket/prefix: also start an S3 server with the bucket (default: $POOLBENCH_STORE)")] = None,
    models: Annotated[str, typer.Option(help="comma-separated model ids/paths the HTTP app may load")] = "embedded",
    num_cpus: Annotated[int | None, typer.Option(help="CPUs our Ray head offers (default: all)")] = None,
    run: Annotated[Path | None, typer.Option(help="a run folder: /score serves the scorers it recorded")] = None,
    serve: Annotated[bool, typer.Option(help="deploy the HTTP app (--no-serve: Ray and S3 only)")] = True,
    steering_backend: Annotated[str, typer.Option(
        help="/generate on transformers or vllm (GPU or CPU)")] = "transformers",
    state: State = STATE_DIR,
    token: Annotated[str | None, typer.Option(
        envvar="POOLBENCH_TOKEN", show_envvar=True,
        help="bearer token the HTTP app requires (>= 16 characters); needed when --host is beyond loopback")] = None,
) -> None:
    """Start our own Ray head, the HTTP app into it only, and an S3 server for an s3:// store."""
    import os

    from poolbench.http.access import TOKEN_ENV, check_exposure, with_token
    from poolbench.http.settings import ServiceSettings

    if serve:
        check_exposure(host, with_token(ServiceSettings(models=()), token).token)
    if token:
        os.environ[TOKEN_ENV] = token  # the deploy session inherits it; never on a command line
    info = cluster_up(ray_port=ray_port, ray_host=ray_host, serve_port=serve_port, host=host, s3_port=s3_port,
                      store=store, models=models.split(","), num_cpus=num_cpus, state=state, serve=serve, run=run,
                      steering_backend=steering_backend)
    shown = ("ray_address", "serve_url", "s3_endpoint", "store", "cluster_id")
    typer.echo(" · ".join(f"{key} {info[key]}" for key in shown if key in info))
    typer.echo(f"next: env $(cat {state / 'ray.env'}) poolbench-driver run --address {info['ray_address']}")


@cluster_app.command("down")
def down(state: State = STATE_DIR) -> None:
    """Stop exactly what `cluster up` started (gracefully first) and say what was stopped."""
    stopped = cluster_down(state)
    typer.echo("stopped: " + ("; ".join(stopped) if stopped else "nothing was running"))
