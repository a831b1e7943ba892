"""The embedded local cluster: the emulated Kubernetes API, the real operator process and a pod runner that
runs each pod's containers as local processes. `make test` runs its scenario; `make demo` shows it."""
