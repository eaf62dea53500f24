"""Typed records: what a run produces, as data every reader (results, report, HTTP, CLI) shares."""
