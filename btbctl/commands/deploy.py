"""``btbctl deploy render``: Kubernetes manifests of the fleet a cluster file describes (the same file ``btbctl up``
reads; its ``[kubernetes]`` section says where and how). Engine modules are imported inside the command."""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands.app import BtbTyper, app
from btbctl.commands.options import OutputFormat
from btbctl.commands.output import Format, Output
from btbctl.engine.wording import plural

deploy_app = BtbTyper(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.add_typer(deploy_app, name="deploy", help="Render the fleet of a cluster file for Kubernetes.")

#: First lines of every rendered file.
HEADER = (
    "# Rendered by `btbctl deploy render -c {config}` (btbctl {version}); edit the cluster file and render again,\n"
    "# or patch it in a kustomize overlay. Secrets are not in here: create the Secret {secret} yourself.\n"
)


@deploy_app.command("render")
def render(
    config: Annotated[
        str,
        typer.Option("-c", "--config", metavar="FILE", help="Cluster file (TOML) with a [kubernetes] section."),
    ],
    out_dir: Annotated[
        str | None,
        typer.Option(
            "-o",
            "--out",
            metavar="DIR",
            help="Write one YAML file per component and a kustomization.yaml into DIR (a kustomize base). "
            "Default: every object as one YAML stream on stdout (for kubectl apply -f -).",
        ),
    ] = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Render Kubernetes manifests (gateway, workers, node agents) from a cluster file; secret values never."""
    import os
    import sys

    from btbctl import __version__
    from btbctl.engine.deploy import kubernetes as kube
    from btbctl.engine.launcher.cluster import load_cluster

    out = Output(fmt)
    cluster = load_cluster(config)
    manifests = kube.render(cluster, config)
    k8s = cluster.kubernetes
    assert k8s is not None  # render refuses a file without [kubernetes]
    header = HEADER.format(config=os.path.basename(config), version=__version__, secret=k8s.secret_name)
    objs = kube.objects(manifests)
    if out_dir is None:
        sys.stdout.write(header + kube.dump_all(objs))
        return
    paths = kube.write(manifests, k8s, out_dir, header)
    summary = {
        "out": out_dir,
        "files": paths,
        "objects": [
            {"kind": o["kind"], "name": o["metadata"]["name"], "file": m.name} for m in manifests for o in m.objects
        ],
        "namespace": k8s.namespace,
        "secret": k8s.secret_name,
        "secrets": kube.secrets_needed(objs),
    }

    def secrets_line(d: dict) -> str:
        parts = [
            f"{name} (key{'s' if len(keys) > 1 else ''} {', '.join(keys)})" if keys else name
            for name, keys in d["secrets"].items()
        ]
        return f"the Secret{'s' if len(parts) > 1 else ''} {' and '.join(parts)}" if parts else "no Secret"

    out.result(
        summary,
        lambda s: out.console.print(
            f"wrote {plural(len(s['objects']), 'object')} in {plural(len(s['files']), 'file')} to {s['out']} "
            f"(namespace {s['namespace']}); "
            + (
                f"kubectl apply -f {os.path.join(s['out'], 'namespace.yaml')}, create {secrets_line(s)} in it, "
                if any(o["kind"] == "Namespace" for o in s["objects"])
                else f"create {secrets_line(s)} first, "
            )
            + f"then: kubectl apply -k {s['out']}",
            soft_wrap=True,
        ),
    )
