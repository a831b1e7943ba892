"""Cluster tests: `local/` (the emulated API, the operator process, a local pod runner; part of `make test`)
and `kind/` (a real cluster, opt-in: `make e2e-kind`)."""
