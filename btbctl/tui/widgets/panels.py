"""The dashboard's five panels. Each has ``update_snapshot(snapshot)``; none talks to the fleet itself."""

from __future__ import annotations

import math
from collections import deque

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Input, Label, Static

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyState
from btbctl.engine.dashboard import FleetSnapshot, PrefixRow
from btbctl.tui.widgets.fmt import bar, human_bytes, human_tokens, seconds, sparkline

#: Snapshots of history kept per prefix for its sparkline.
SPARK_POINTS = 12


class PrefixPanel(Vertical):
    """Top prefixes by arrivals in the detector window, with a row cursor (the selection ``r`` replicates)."""

    BORDER_TITLE = "1 Prefix heat"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._history: dict[str, deque[int]] = {}
        self.rows: list[PrefixRow] = []

    def compose(self) -> ComposeResult:
        table = DataTable(id="prefix-table", cursor_type="row", zebra_stripes=False, cell_padding=0)
        yield table

    def on_mount(self) -> None:
        t = self.query_one(DataTable)
        t.add_column("prefix", key="id", width=13)
        t.add_column("len", key="len", width=4)
        t.add_column("arr/X", key="arr", width=6)
        t.add_column("hold", key="hold", width=5)
        t.add_column("cp", key="cp", width=3)
        t.add_column("trend", key="trend", width=5)

    @property
    def selected(self) -> PrefixRow | None:
        t = self.query_one(DataTable)
        if not self.rows or t.cursor_row < 0 or t.cursor_row >= len(self.rows):
            return None
        return self.rows[t.cursor_row]

    def update_snapshot(self, snap: FleetSnapshot) -> None:
        t = self.query_one(DataTable)
        keep = self.selected.prefix_id if self.selected else None
        seen = set()
        for p in snap.prefixes:
            h = self._history.setdefault(p.prefix_id, deque(maxlen=SPARK_POINTS))
            h.append(p.arrivals_in_window)
            seen.add(p.prefix_id)
        for pid in [k for k in self._history if k not in seen]:
            del self._history[pid]
        self.rows = list(snap.prefixes)
        t.clear()
        for p in self.rows:
            arr = Text(f"{p.arrivals_in_window}/{p.threshold}", style="bold red" if p.hot else "")
            cp = str(p.copies_in_flight) if p.copies_in_flight else "-"
            t.add_row(
                p.short_id,
                human_tokens(p.prefix_tokens),
                arr,
                str(p.holders),
                cp,
                sparkline(self._history[p.prefix_id], 5),
                key=p.prefix_id,
            )
        if keep is not None:
            for i, p in enumerate(self.rows):
                if p.prefix_id == keep:
                    t.move_cursor(row=i, animate=False)
                    break
        self.border_subtitle = f"{len(self.rows)} tracked"


class FleetPanel(VerticalScroll):
    """Workers (health, running/queued, KV use) and GPUs (HBM used/total, utilisation)."""

    BORDER_TITLE = "2 Fleet / HBM"
    can_focus = True

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-body")

    def update_snapshot(self, snap: FleetSnapshot) -> None:
        w = Table(box=None, pad_edge=False, expand=True, show_edge=False, padding=(0, 1))
        for col, just in (("worker", "left"), ("ok", "left"), ("run", "right"), ("queue", "right"), ("KV", "left")):
            w.add_column(col, justify=just, no_wrap=True)
        for row in snap.workers:
            ok = Text("up", style="green") if row.healthy else Text("DOWN", style="bold red")
            if row.kv_capacity_tokens:
                frac = (row.kv_used_tokens or 0) / row.kv_capacity_tokens
                kv = f"{bar(frac, 6)} {frac * 100:3.0f}%"
            else:
                kv = "-"
            w.add_row(row.name, ok, str(row.running), str(row.queued), kv)
        parts: list = [w]
        if snap.gpus:
            g = Table(box=None, pad_edge=False, expand=True, show_edge=False, padding=(0, 1))
            for col, just in (("gpu", "left"), ("HBM", "right"), ("util", "right"), ("via", "left")):
                g.add_column(col, justify=just, no_wrap=True)
            for gpu in snap.gpus:
                util = "-" if gpu.util_pct is None else f"{gpu.util_pct:.0f}%"
                g.add_row(gpu.name, f"{human_bytes(gpu.used_bytes)}/{human_bytes(gpu.total_bytes)}", util, gpu.source)
            parts.append(g)
        if snap.gpu_note:
            parts.append(Text(snap.gpu_note, style="yellow"))
        from rich.console import Group

        self.query_one("#fleet-body", Static).update(Group(*parts))
        down = sum(1 for r in snap.workers if not r.healthy)
        self.border_subtitle = (
            f"{len(snap.workers)} workers"
            + (f", {down} down" if down else "")
            + (f", copies {snap.replication}" if snap.replication else "")
        )


class TransferPanel(VerticalScroll):
    """KV-cache copies in flight, then recent ones: prefix, source -> target, progress, rate, ETA, result."""

    BORDER_TITLE = "3 Transfers"
    can_focus = True
    _last: FleetSnapshot | None = None

    def on_resize(self) -> None:
        if self._last is not None:  # the columns depend on the width
            self.update_snapshot(self._last)

    def compose(self) -> ComposeResult:
        yield Static(id="transfer-body")

    def update_snapshot(self, snap: FleetSnapshot) -> None:
        self._last = snap
        wide = self.size.width >= 60
        lines = Text(no_wrap=True, overflow="ellipsis")
        lines.append(
            (
                "prefix   route   progress       rate      eta   state"
                if wide
                else "prefix route  progress    eta  state"
            ),
            style="bold",
        )
        live = 0
        for x in snap.transfers:
            style = {CopyState.DONE: "green", CopyState.FAILED: "bold red", CopyState.STALLED: "yellow"}.get(
                CopyState(x.state), "cyan"
            )
            if not CopyState(x.state).final:
                live += 1
            state = x.state if not x.error else f"{x.state}: {x.error}"
            if x.proof_storage_tokens is not None:  # an l3 copy's proof: tokens its target loaded from L3
                state += f" (proof {human_tokens(x.proof_storage_tokens)} from L3)"
            route = f"{x.source}>{x.target}"
            pct = f"{x.fraction * 100:3.0f}%"
            if wide:
                rate = f"{human_bytes(x.bytes_per_s)}/s" if x.bytes_per_s else "-"
                row = f"{x.prefix_id[:8]} {route:7} {bar(x.fraction, 8)} {pct} {rate:>9} {seconds(x.eta_s):>6}   "
            else:
                row = f"{x.prefix_id[:6]} {route:6} {bar(x.fraction, 5)}{pct} {seconds(x.eta_s):>5}  "
            lines.append("\n" + row)
            lines.append(state, style=style)
        t = lines
        body = t if snap.transfers else Text("no transfers yet", style="dim")
        self.query_one("#transfer-body", Static).update(body)
        self.border_subtitle = f"{live} in flight"


class TtftPanel(Vertical):
    """TTFT p50 and p95 over time (plotext), with the policy and requests/s in the title line."""

    BORDER_TITLE = "4 TTFT"

    def compose(self) -> ComposeResult:
        from textual_plotext import PlotextPlot

        yield Static(id="ttft-head")
        yield PlotextPlot(id="ttft-plot")

    def on_mount(self) -> None:
        self.query_one("#ttft-plot").plt.theme("clear")

    def update_snapshot(self, snap: FleetSnapshot) -> None:
        from textual_plotext import PlotextPlot

        pts = [p for p in snap.ttft if not math.isnan(p.p50_s)]
        last = pts[-1] if pts else None
        head = f"{snap.policy or '-'} {snap.rps:.0f} req/s"
        if last is not None:
            head += f" p50 {seconds(last.p50_s)} p95 {seconds(last.p95_s)}"
        self.query_one("#ttft-head", Static).update(head)
        plot = self.query_one("#ttft-plot", PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        if pts:
            xs = [p.t_s for p in pts]
            plt.plot(xs, [p.p50_s for p in pts], label="p50", marker="braille")
            plt.plot(xs, [p.p95_s for p in pts], label="p95", marker="braille")
        plt.xlabel("t (s)")
        plot.refresh()


class ConstantsPanel(Vertical):
    """BTB's four constants, editable (Enter sends a field), the policy, and what the fleet confirmed."""

    BORDER_TITLE = "5 Constants"
    FIELDS = tuple(zip(BtbConstants.keys(), ("Y blk", "X arr", "Z s", "M"), strict=True))

    def compose(self) -> ComposeResult:
        with Horizontal(id="const-row"):
            for key, label in self.FIELDS:
                yield Label(f"{label} ", classes="const-label")
                yield Input(id=f"const-{key}", compact=True, classes="const-input", select_on_focus=True)
            yield Label("", id="const-policy")
        yield Label("", id="const-status")

    def update_snapshot(self, snap: FleetSnapshot, force: bool = False) -> None:
        for key, _ in self.FIELDS:
            inp = self.query_one(f"#const-{key}", Input)
            if key in snap.constants and (force or not inp.has_focus):
                val = str(snap.constants[key])
                if inp.value != val:
                    inp.value = val
        self.query_one("#const-policy", Label).update(f"policy {snap.policy}")

    def show(self, message: str, error: bool = False) -> None:
        lbl = self.query_one("#const-status", Label)
        lbl.update(Text(message, style="bold red" if error else "green"))
