"""`trainingrun operator`: run the Kopf operator (see docs/operator.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from trainingrun.cliargs import positive_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs allowed); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (the default)")
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--standalone", action="store_true", default=True,
                      help="no peering: one replica (the default; deploy with strategy Recreate)")
    peer.add_argument("--peering", metavar="NAME", default=None,
                      help="use kopf peering object NAME (several replicas, one active; see docs/operator.md)")
    parser.add_argument("--bind", default="0.0.0.0", help="address of the liveness and metrics servers")
    parser.add_argument("--liveness-port", type=int, default=8080, help="/healthz port; 0 turns it off")
    parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port; 0 turns it off")
    parser.add_argument("--interval", type=positive_seconds, default=10.0,
                        help="reconcile every run at least this often, in seconds (progress refresh, hang detection)")
    parser.add_argument("--redis-image", default=None, help="image of managed stores (default redis:7.2-alpine)")
    parser.add_argument("--api-workers", type=int, default=8, metavar="N",
                        help="the operator's own API calls run in a pool of N threads (default 8): at most N in "
                        "flight; kopf's watches are separate")
    parser.add_argument("-v", "--verbose", action="store_true", help="more logs")
    parser.add_argument("--debug", action="store_true", help="kopf debug logs")


def run(args: argparse.Namespace) -> int:
    import kopf  # deferred: kopf (the `operator` command only)
    from prometheus_client import start_http_server  # deferred: prometheus_client

    from trainingrun.operator import handlers, metrics  # deferred: kopf; importing handlers registers them

    if not 0 < args.interval <= 30:
        raise SystemExit(f"--interval: {args.interval} is out of range; allowed: 0 < interval <= 30 seconds "
                         "(progress must reach the status at least every 30 s)")
    if not 1 <= args.api_workers <= 64:
        raise SystemExit(f"--api-workers: {args.api_workers} is out of range; allowed: 1 to 64")
    for opt in ("liveness_port", "metrics_port"):
        if not 0 <= getattr(args, opt) <= 65535:
            raise SystemExit(f"--{opt.replace('_', '-')}: {getattr(args, opt)} is not a port (0-65535)")
    kopf.configure(verbose=args.verbose, debug=args.debug)
    logging.getLogger("trainingrun").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    settings = {"interval": args.interval, "api_workers": args.api_workers}
    if args.redis_image:
        settings["redis_image"] = args.redis_image
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.bind, registry=metrics.REGISTRY)
    liveness = f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port else None
    namespaces = list(args.namespace)
    asyncio.run(kopf.operator(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=liveness,
        memo=handlers.operator_memo(**settings),
    ))
    return 0
