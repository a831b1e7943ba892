"""Pure builders: a Stage in, Kubernetes objects out (pods, the Service, the stage ConfigMap). No API calls."""
