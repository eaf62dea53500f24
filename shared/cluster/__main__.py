"""`python -m poolbench.cluster up|down`: the same commands as `poolbench-driver cluster up|down`."""

import sys

from poolbench.cluster.commands import cluster_app
from poolbench.errors import PoolBenchError

try:
    cluster_app(prog_name="python -m poolbench.cluster")
except PoolBenchError as exc:
    print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
    sys.exit(1)
