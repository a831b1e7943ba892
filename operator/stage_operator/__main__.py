"""`python -m stage_operator`: the DiffusionStage operator (kopf), namespaced or cluster-wide, with peering."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kopf
import prometheus_client

from stage_operator.settings import DEFAULT_RESYNC_SECONDS, OperatorSettings


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
    p.add_argument("--resync-seconds", type=float, default=DEFAULT_RESYNC_SECONDS,
                   help=f"re-reconcile every stage this often (default {DEFAULT_RESYNC_SECONDS:g})")
    p.add_argument("--verbose", action="store_true")
    return p


def kopf_options(args: argparse.Namespace) -> dict | str:
    """What `kopf.run`/`kopf.operator` take from the flags (scope, peering, liveness), or the usage error."""
    namespaces = args.namespace or [n for n in os.environ.get("WATCH_NAMESPACE", "").split(",") if n]
    if not args.all_namespaces and not namespaces:
        return "give --namespace NS (or $WATCH_NAMESPACE) or --all-namespaces"
    return dict(clusterwide=args.all_namespaces, namespaces=namespaces, standalone=args.standalone,
                peering_name=args.peering, priority=args.priority, liveness_endpoint=args.liveness)


def settings(args: argparse.Namespace) -> OperatorSettings:
    return OperatorSettings(resync_seconds=args.resync_seconds)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = kopf_options(args)
    if isinstance(options, str):
        print(options, file=sys.stderr)
        return 2
    try:
        config = settings(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port is not None:
        prometheus_client.start_http_server(args.metrics_port)
    import stage_operator.handlers  # noqa: F401 (registers the handlers)

    kopf.run(**options, memo=kopf.Memo(config=config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
