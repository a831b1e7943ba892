"""`make e2e-kind`: the scenario of e2e/scenario.py on a real kind cluster (opt-in; needs Docker and kind)."""
