"""``btbctl agent``: run the node agent of BTB on stock SGLang (page store, local socket, peer copies, control)."""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands.app import app


@app.command("agent")
def agent(
    secret_file: Annotated[
        str,
        typer.Option(
            "--secret-file",
            help="File holding this node's credentials (written by btbctl up: it speaks to its peers only as "
            "itself), or the fleet secret (at least 16 bytes, the same on every agent; every key derived from it).",
        ),
    ],
    arena_mib: Annotated[
        int, typer.Option("--arena-mib", help="Byte budget of the page store, MiB (shared memory).")
    ] = 1024,
    socket_path: Annotated[
        str, typer.Option("--socket", metavar="FILE", help="Unix socket the local BtbL3Store instances connect to.")
    ] = "/run/btbctl/agent.sock",
    peer: Annotated[
        str, typer.Option("--peer", metavar="HOST:PORT", help="Address peers connect to (authenticated first).")
    ] = "127.0.0.1:0",
    control: Annotated[
        str,
        typer.Option(
            "--control",
            metavar="HOST:PORT",
            help="Address of the control API and /metrics (loopback only without --control-token-file).",
        ),
    ] = "127.0.0.1:0",
    control_token_file: Annotated[
        str | None,
        typer.Option(
            "--control-token-file",
            help="File holding the control API's bearer token (default: none; then only bind to loopback).",
        ),
    ] = None,
    agent_id: Annotated[
        str | None,
        typer.Option("--agent-id", help="This agent's id in logs and peers' logs (default: hostname-random)."),
    ] = None,
    idle_timeout_s: Annotated[
        float, typer.Option("--idle-timeout-s", help="Cut off a peer silent this long, seconds.")
    ] = 10.0,
    file_dir: Annotated[
        str | None,
        typer.Option(
            "--file-dir",
            help="File mode: copy the page files of SGLang's "
            "stock 'file' L3 backend in this (node-local) directory instead "
            "of serving BtbL3Store; --arena-mib then sizes the staging "
            "area.",
        ),
    ] = None,
    gateway: Annotated[
        list[str] | None,
        typer.Option(
            "--gateway",
            metavar="URL",
            help="Control URL of a gateway to register with (repeatable): this agent announces its node, copy "
            "address, control URL and the workers connected to its socket, signed with its node key.",
        ),
    ] = None,
    gateway_service: Annotated[
        list[str] | None,
        typer.Option(
            "--gateway-service",
            metavar="URL",
            help="http://NAME:PORT whose NAME resolves to every gateway (a headless Service; repeatable): at each "
            "announcement this agent resolves it and registers with every address, besides --gateway.",
        ),
    ] = None,
    register_interval_s: Annotated[
        float,
        typer.Option(
            "--register-interval-s", help="Seconds between announcements (a gateway drops an agent after 3 missed)."
        ),
    ] = 5.0,
    transport: Annotated[
        str,
        typer.Option(
            "--transport", help="auto, tcp or rdma (auto: RDMA where a device and the pyverbs layer exist, else TCP)."
        ),
    ] = "auto",
) -> None:
    """Run the node agent. Prints 'ready peer HOST:PORT control HOST:PORT socket PATH' when listening."""
    from urllib.parse import urlsplit

    from btbctl.engine.agent.agent import AgentConfig, parse_gateway_service, read_secret, run
    from btbctl.engine.errors import ConfigError
    from btbctl.engine.replication.transport import TransferError, parse_address

    def addr(opt: str, value: str) -> tuple[str, int]:
        ephemeral = value.rpartition(":")[2] == "0"
        try:  # parse_address wants a port in 1..65535; port 0 means ephemeral here
            host, port = parse_address(value[:-1] + "1" if ephemeral else value)
        except TransferError as e:
            raise ConfigError(
                opt, str(e).replace("bad target address", "bad address") + " (HOST:PORT, port 0 = ephemeral)"
            ) from None
        return host, 0 if ephemeral else port

    if arena_mib < 1:
        raise ConfigError("--arena-mib", f"must be >= 1, got {arena_mib}")
    if idle_timeout_s <= 0:
        raise ConfigError("--idle-timeout-s", f"must be > 0, got {idle_timeout_s}")
    for url in gateway or ():
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise ConfigError("--gateway", f"{url!r} must be the gateway's control URL (http://host:port)")
    for url in gateway_service or ():
        parse_gateway_service(url)
    peer_host, peer_port = addr("--peer", peer)
    control_host, control_port = addr("--control", control)
    token = read_secret(control_token_file, "control token file").decode() if control_token_file else None
    run(
        AgentConfig(
            socket_path=socket_path,
            arena_bytes=arena_mib << 20,
            secret=read_secret(secret_file),
            peer_host=peer_host,
            peer_port=peer_port,
            control_host=control_host,
            control_port=control_port,
            control_token=token,
            agent_id=agent_id,
            idle_timeout_s=idle_timeout_s,
            transport=transport,
            file_dir=file_dir,
            gateways=tuple(gateway or ()),
            gateway_services=tuple(gateway_service or ()),
            register_interval_s=register_interval_s,
        )
    )
