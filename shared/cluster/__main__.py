"""`python -m poolbench.cluster up|down`, as `make cluster-up` / `make cluster-down` call it."""

import sys

from poolbench.cluster.launcher import main

sys.exit(main())
