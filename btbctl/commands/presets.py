"""``btbctl presets``: the model, GPU and fabric presets of the cost model, with their sources."""

from __future__ import annotations

from btbctl.commands.app import app
from btbctl.commands.options import OutputFormat
from btbctl.commands.output import Format, Output

#: Where each fabric figure of ``costmodel.FABRICS`` comes from (bytes/s per replica-side link).
FABRIC_SOURCES = {
    "rdma-8x400g": "Mooncake Transfer Engine, measured on 8 x 400G RoCE",
    "rdma-4x200g": "Mooncake Transfer Engine, measured on 4 x 200G RoCE",
    "rdma-1x400g": "ConnectX-7 400 Gb/s, achieved rate of one NIC",
    "tcp": "kernel TCP, measured (Mooncake Transfer Engine comparison)",
    "100gbe": "100 Gb/s Ethernet line rate",
}


def presets_report() -> dict:
    """``{"models": [...], "gpus": [...], "fabrics": [...]}`` with raw units (counts, bytes, bytes/s, FLOP/s) and
    each preset's source; stable keys, presets in definition order."""
    from btbctl.engine.costmodel import FABRICS, GPUS, MODELS

    models = []
    for m in MODELS.values():
        kv_dtype = m.dtype_bytes if m.kv_dtype_bytes is None else m.kv_dtype_bytes
        models.append(
            {
                "name": m.name,
                "total_params": m.total_params,
                "active_params": m.active_params,
                "dtype_bytes": m.dtype_bytes,
                "kv_dtype_bytes": kv_dtype,
                "layers": m.layers,
                "kv_heads": m.kv_heads,
                "head_dim": m.head_dim,
                "attn_dim": m.attn_dim,
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "kv_kb_per_token": m.kv_bytes_per_token / 1e3,
                "weight_bytes": m.weight_bytes,
                "context_tokens": m.context_tokens,
                "source": m.source,
            }
        )
    gpus = [
        {
            "name": g.name,
            "flop_per_s": g.flops,
            "hbm_bytes": g.hbm_bytes,
            "hbm_bytes_per_s": g.hbm_bytes_per_s,
            "pcie_bytes_per_s": g.pcie_bytes_per_s,
            "nic_bytes_per_s": g.nic_bytes_per_s,
            "source": g.source,
        }
        for g in GPUS.values()
    ]
    fabrics = [
        {
            "name": name,
            "bytes_per_s": bw,
            "source": FABRIC_SOURCES.get(name, "btbctl.engine.costmodel.FABRICS"),
        }
        for name, bw in FABRICS.items()
    ]
    return {"models": models, "gpus": gpus, "fabrics": fabrics}


def _num(x: float) -> str:
    return f"{x:g}" if x < 1e4 else f"{x:.3g}"


def render_human(out: Output, r: dict) -> None:
    """Three rich tables: models, GPUs, fabrics."""
    from rich import box
    from rich.table import Table

    con = out.console
    mt = Table(
        title="Model presets (params total / active; dtype = bytes per element; kB = 1e3 bytes)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for col, just in (
        ("name", "left"),
        ("total", "right"),
        ("active", "right"),
        ("dtype", "right"),
        ("layers", "right"),
        ("KV\nheads", "right"),
        ("head\ndim", "right"),
        ("KV bytes\n/token", "right"),
        ("KV kB\n/token", "right"),
        ("context", "right"),
    ):
        mt.add_column(col, justify=just, no_wrap=col == "name")
    for m in r["models"]:
        mt.add_row(
            m["name"],
            f"{m['total_params'] / 1e9:g}B",
            f"{m['active_params'] / 1e9:g}B",
            f"{m['dtype_bytes']:g}",
            str(m["layers"]),
            str(m["kv_heads"]),
            str(m["head_dim"]),
            f"{m['kv_bytes_per_token']:.0f}",
            f"{m['kv_kb_per_token']:.4g}",
            f"{m['context_tokens']:,}",
        )
    con.print(mt)

    gt = Table(title="GPU presets (per GPU; GB = 1e9 bytes)", title_justify="left")
    for col, just in (
        ("name", "left"),
        ("TFLOP/s", "right"),
        ("HBM GB", "right"),
        ("HBM TB/s", "right"),
        ("PCIe GB/s", "right"),
        ("NIC GB/s", "right"),
    ):
        gt.add_column(col, justify=just)
    for g in r["gpus"]:
        gt.add_row(
            g["name"],
            f"{g['flop_per_s'] / 1e12:g}",
            f"{g['hbm_bytes'] / 1e9:g}",
            f"{g['hbm_bytes_per_s'] / 1e12:g}",
            f"{g['pcie_bytes_per_s'] / 1e9:g}",
            f"{g['nic_bytes_per_s'] / 1e9:g}",
        )
    con.print(gt)

    ft = Table(
        title="Fabrics (KV copy bandwidth per replica-side link; btbctl dry-run --fabric NAME)", title_justify="left"
    )
    ft.add_column("name")
    ft.add_column("GB/s", justify="right")
    ft.add_column("source")
    for f in r["fabrics"]:
        ft.add_row(f["name"], f"{f['bytes_per_s'] / 1e9:g}", f["source"])
    con.print(ft)

    con.print("Sources:")
    for m in r["models"]:
        con.print(f"  {m['name']}: {m['source']}")
    for g in r["gpus"]:
        con.print(f"  {g['name']}: {g['source']}")


@app.command("presets")
def presets(
    fmt: OutputFormat = Format.human,
) -> None:
    """List the model, GPU and fabric presets of the cost model (KV bytes per token, FLOP/s, bandwidths)."""
    out = Output(fmt)
    out.result(presets_report(), lambda r: render_human(out, r))
