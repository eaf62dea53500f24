"""poolbench-driver: Typer commands, each parsing its options and calling one function (application)."""
