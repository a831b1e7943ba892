"""`python -m stage_operator`: the DiffusionStage operator (kopf), namespaced or cluster-wide, with peering."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kopf
import prometheus_client


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stage_operator", description=__doc__.splitlines()[0])
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="serve this namespace (repeatable; globs allowed); default: $WATCH_NAMESPACE")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace (cluster-wide)")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peering", metavar="NAME", help="coordinate replicas through this KopfPeering (HA)")
    peer.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    p.add_argument("--priority", type=int,
                   help="peering priority: the highest live replica works (default: random, so replicas never tie)")
    p.add_argument("--liveness", metavar="URL", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (/metrics)")
    p.add_argument("--resync-seconds", type=float, help="re-reconcile every stage this often (default 30)")
    p.add_argument("--endpoint-annotation", action="store_true",
                   help="reach a pod at its annotation diffstage.io/endpoint (a URL) instead of its pod IP: for "
                        "local runs and tests where pods are stood in for by local processes; off in clusters")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    namespaces = args.namespace or [n for n in os.environ.get("WATCH_NAMESPACE", "").split(",") if n]
    if not args.all_namespaces and not namespaces:
        print("give --namespace NS (or $WATCH_NAMESPACE) or --all-namespaces", file=sys.stderr)
        return 2
    if args.endpoint_annotation:
        os.environ["DIFFSTAGE_ENDPOINT_ANNOTATION"] = "1"
    if args.resync_seconds is not None:
        os.environ["DIFFSTAGE_RESYNC_SECONDS"] = str(args.resync_seconds)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port is not None:
        prometheus_client.start_http_server(args.metrics_port)
    import stage_operator.handlers  # noqa: F401 (registers the handlers)

    kopf.run(clusterwide=args.all_namespaces, namespaces=namespaces, standalone=args.standalone,
             peering_name=args.peering, priority=args.priority, liveness_endpoint=args.liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main())
