"""``mlxrt serve``'s flags for what a request gets when it leaves something out, and for who may
call from a browser or name a local image: ``--max-tokens``, ``--strict-max-tokens``,
``--allowed-origins``, ``--media-dir`` (docs/http.md); and where engines run: ``--ray``,
``--replicas``, ``--node-kv-budget-mib`` (docs/cluster.md). Apart from serve.py so the serve
command's other flags can change without them."""

from __future__ import annotations

import argparse

from runtime.cluster.options import ClusterConfig


def add_request_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="token limit of requests that send none (default: 16 for /v1/completions as OpenAI, "
        "the rest of the context up to 4096 for chat); mlx_lm.server's is 512",
    )
    serve.add_argument(
        "--strict-max-tokens",
        action="store_true",
        help="refuse a max_tokens past the room the prompt leaves in the context "
        "(default: lower it to that room, as llama-server and mlx_lm.server do)",
    )
    serve.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help='browser origins allowed to call the API (CORS), e.g. http://localhost:3000, or "*" '
        "for any; default: none (a browser page on another origin cannot call it)",
    )
    serve.add_argument(
        "--media-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory whose image files image_url parts may name (file:// URLs or absolute "
        "paths), repeatable; default: none (only data URLs)",
    )
    serve.add_argument(
        "--fetch-images",
        action="store_true",
        help="fetch remote (http/https) image_url parts, each at most 20 MiB within 10 s "
        "(default: refused; the server then reaches any address a client names)",
    )


def add_cluster_flags(serve: argparse.ArgumentParser) -> None:
    """``--ray [ADDRESS]``, ``--replicas N`` and ``--node-kv-budget-mib`` (docs/cluster.md)."""
    serve.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="run every engine as a Ray actor in a process of its own (the [cluster] extra): "
        "alone, on a local Ray started here; with ADDRESS, on the cluster whose head is there "
        "(HOST:PORT from `ray start --head`, or auto)",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="engines per model (NAME@0 ... NAME@N-1, each with its own KV), requests routed "
        "to the one holding the longest prefix of their prompt (default 1)",
    )
    serve.add_argument(
        "--node-kv-budget-mib",
        action="append",
        default=[],
        metavar="[NODE=]MIB",
        help="with --ray: the KV budget of the engines on each node (MIB), or on one node "
        "(NODE=MIB: a Ray node id or IP address); repeatable (default: --kv-budget-mib on "
        "every node)",
    )


def cluster_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> ClusterConfig | None:
    """The ``ClusterConfig`` that ``--ray`` and ``--node-kv-budget-mib`` ask for (None: no Ray);
    a usage error (exit 2) for a budget without ``--ray`` or one that does not parse."""
    if args.ray is None:
        if args.node_kv_budget_mib:
            parser.error("--node-kv-budget-mib budgets the nodes of a Ray cluster: add --ray")
        return None
    per_node: int | None = None
    nodes: dict[str, int] = {}
    for value in args.node_kv_budget_mib:
        node, _, mib = value.rpartition("=")
        if not mib.isdigit() or (node == "" and "=" in value):
            parser.error(
                f"--node-kv-budget-mib takes MIB or NODE=MIB (a Ray node id or IP address and "
                f"a whole number of MiB), got {value!r}"
            )
        if node:
            nodes[node] = int(mib) << 20
        else:
            per_node = int(mib) << 20
    address = None if args.ray == "local" else args.ray  # --ray alone: a local Ray
    return ClusterConfig(
        address=address, node_kv_budget_bytes=nodes, kv_budget_bytes_per_node=per_node
    )


def check_request_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A usage error (exit 2) for a ``--max-tokens`` below 1."""
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1 (got {args.max_tokens})")
    if args.replicas < 1:
        parser.error(f"--replicas must be at least 1 (got {args.replicas})")
