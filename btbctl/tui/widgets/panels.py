"""The dashboard's five panels. Each has ``update_snapshot(snapshot)``; none talks to the fleet itself."""

from __future__ import annotations

import math
from collections import deque

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Input, Label, Static

from btbctl.engine.chains import short_id
from btbctl.engine.constants import BtbConstants
from btbctl.engine.control.schema import TTFT_RECENT_WINDOW_S
from btbctl.engine.copies import CopyState
from btbctl.engine.dashboard import FleetSnapshot, PrefixRow
from btbctl.tui.widgets.fmt import bar, human_bytes, human_tokens, kv_bar, seconds, sparkline

#: Snapshots of history kept per prefix for its sparkline.
SPARK_POINTS = 12


class PrefixPanel(Vertical):
    """Top prefixes by arrivals in the detector window, with a row cursor (the selection ``r`` replicates).

    The selection is kept by prefix id: when a snapshot re-sorts the list, the cursor moves with the prefix it was
    on, so ``r`` replicates the prefix the user sees highlighted. When that prefix leaves the list the cursor stays
    at its row, on whatever prefix is shown there."""

    BORDER_TITLE = "1 Prefix heat"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._history: dict[str, deque[int]] = {}
        self.rows: list[PrefixRow] = []

    def compose(self) -> ComposeResult:
        table = DataTable(id="prefix-table", cursor_type="row", zebra_stripes=False, cell_padding=0)
        yield table
        yield Static("", id="prefix-empty")

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
        """The prefix of the highlighted row (what ``r`` replicates), None when the list is empty."""
        t = self.query_one(DataTable)
        if not self.rows or not 0 <= t.cursor_row < t.row_count:
            return None
        key = t.coordinate_to_cell_key(t.cursor_coordinate).row_key.value
        return next((p for p in self.rows if p.prefix_id == key), None)

    def update_snapshot(self, snap: FleetSnapshot) -> None:
        t = self.query_one(DataTable)
        was = self.selected
        keep = was.prefix_id if was is not None else None
        keep_row = t.cursor_row
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
        row = next((i for i, p in enumerate(self.rows) if p.prefix_id == keep), None)
        if row is None:
            row = min(max(keep_row, 0), max(len(self.rows) - 1, 0))
        if self.rows:
            t.move_cursor(row=row, animate=False)
        empty = self.query_one("#prefix-empty", Static)
        empty.display = not self.rows
        if not self.rows:
            empty.update(Text(empty_heat_hint(snap.constants), style="dim"))
        self.border_subtitle = f"{len(self.rows)} tracked"


def empty_heat_hint(constants: dict) -> str:
    """Why the heat list is empty: no prompt carried a prefix of ``prefix_blocks`` blocks inside the window."""
    y, z = constants.get("prefix_blocks"), constants.get("window_s")
    if y is None:
        return "no prefix seen yet"
    return (
        f"no prefix of {y} blocks seen yet (prefix_blocks={y}: shorter prompts are not tracked; "
        f"arrivals count over the last {z:g} s)"
    )


#: The fleet panel shows the L3 counters and where each worker's numbers come from from this width on (cells).
FLEET_WIDE = 64
#: How the fleet panel names where a worker's numbers come from (``WorkerRow.source``).
SOURCE_SHORT = {"sglang_metrics": "sglang", "sglang_loads": "loads", "modelled": "model"}
#: What each of those names means (the help screen's legend).
SOURCE_LABELS = {
    "sglang": "SGLang's /metrics",
    "loads": "only SGLang's /v1/loads: no cached prefixes",
    "model": "the cost model: an emulated worker, the simulation",
}


def _tokens(n: int | None) -> str:
    return "-" if n is None else human_tokens(n)


def sources_note(rows) -> str:
    """Where the workers' numbers come from, in a few words for the panel's border: ``via sglang`` (SGLang's
    ``/metrics``), ``via /v1/loads`` (only SGLang's ``/v1/loads``: no cache numbers), ``modelled`` (the cost model),
    or counts when they differ (``2 sglang, 1 model``); empty when unknown."""
    kinds = [r.source for r in rows if r.source]
    if not kinds:
        return ""
    if len(set(kinds)) == 1:
        return {"sglang_metrics": "via sglang", "sglang_loads": "via /v1/loads", "modelled": "modelled"}.get(
            kinds[0], kinds[0]
        )
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{n} {SOURCE_SHORT.get(k, k)}" for k, n in counts.items())


class FleetPanel(VerticalScroll):
    """Workers (health, running/queued, KV cache in use and cached, HiCache host tier; on a wide panel the L3
    counters and where the numbers come from) and GPUs (HBM used/total, utilisation). ``-`` where a worker does not
    report a number."""

    BORDER_TITLE = "2 Fleet / HBM"
    can_focus = True
    _last: FleetSnapshot | None = None

    def on_resize(self) -> None:
        if self._last is not None:  # the columns depend on the width
            self.update_snapshot(self._last)

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-body")

    def update_snapshot(self, snap: FleetSnapshot) -> None:
        self._last = snap
        wide = self.size.width >= FLEET_WIDE
        w = Table(box=None, pad_edge=False, expand=True, show_edge=False, padding=(0, 1), collapse_padding=True)
        cols = [("worker", "left"), ("ok", "left"), ("run", "right"), ("queue", "right"), ("KV", "left")]
        cols.append(("host", "right"))
        if wide:
            cols += [("L3 hit", "right"), ("L3 in", "right"), ("L3 out", "right"), ("via", "left")]
        for col, just in cols:
            w.add_column(col, justify=just, no_wrap=True)
        for row in snap.workers:
            ok = Text("up", style="green") if row.healthy else Text("DOWN", style="bold red")
            held = row.kv_held_fraction
            if held is not None and row.kv_capacity_tokens:
                used = (row.kv_used_tokens or 0) / row.kv_capacity_tokens
                kv = f"{kv_bar(used, held - used, 6)} {percent(held)}"
            else:
                kv = "-"
            cells = [row.name, ok, str(row.running), str(row.queued), kv, _tokens(row.host_tier_tokens)]
            if wide:
                cells += [
                    _tokens(row.storage_hit_tokens_total),
                    _tokens(row.storage_prefetched_tokens_total),
                    _tokens(row.storage_backup_tokens_total),
                    SOURCE_SHORT.get(row.source, row.source or "-"),
                ]
            w.add_row(*cells)
        parts: list = [w]
        if snap.gpus:
            g = Table(box=None, pad_edge=False, expand=True, show_edge=False, padding=(0, 1))
            for col, just in (("gpu", "left"), ("HBM GB", "right"), ("util", "right"), ("via", "left")):
                g.add_column(col, justify=just, no_wrap=True)
            for gpu in snap.gpus:
                util = "-" if gpu.util_pct is None else f"{gpu.util_pct:.0f}%"
                g.add_row(gpu.name, hbm_gb(gpu.used_bytes, gpu.total_bytes), util, gpu.source)
            parts.append(g)
        if snap.gpu_note:
            parts.append(Text(snap.gpu_note, style="yellow"))
        from rich.console import Group

        self.query_one("#fleet-body", Static).update(Group(*parts))
        down = sum(1 for r in snap.workers if not r.healthy)
        note = sources_note(snap.workers)
        self.border_subtitle = (
            f"{len(snap.workers)} workers"
            + (f", {down} down" if down else "")
            + (f", copies {snap.replication}" if snap.replication else "")
            + (f", {note}" if note else "")
        )


def percent(fraction: float) -> str:
    """A share 0..1 as a 4-cell percentage; ``<1%`` for a share above 0 that would round to ``0%`` (a worker
    holding a small cached prefix does not read as empty)."""
    pct = fraction * 100
    return " <1%" if 0 < pct < 0.5 else f"{pct:3.0f}%"


def hbm_gb(used: float, total: float) -> str:
    """HBM in use / size in GB (1e9 bytes, the unit of ``btbctl presets``): ``62.4/80.0``."""
    return f"{used / 1e9:.1f}/{total / 1e9:.1f}"


#: The transfers panel's columns for a wide panel (>= :data:`TRANSFERS_WIDE` cells) and a narrow one. ``prefix`` is
#: the hot prefix's id as the heat panel, ``btbctl prefixes`` and ``btbctl replicate --prefix`` show it
#: (:func:`btbctl.engine.chains.short_id`), ``len`` the tokens copied (a policy may copy a deeper chain than the
#: hot prefix). The state comes last; what it has to say beyond one word (an error, how soon the target could
#: serve the prefix, an l3 proof) goes on an indented line under the row, wrapped to the panel, never cut.
TRANSFERS_WIDE = 70
_WIDE_HEAD = f"{'prefix':12} {'len':>4} {'route':7} {'progress':13} {'size':>7} {'rate':>9} {'time':>6}  state"
_NARROW_HEAD = f"{'prefix':12} {'len':>4} {'route':5} {'size':>6} {'time':>5}\n  state"


def _copied(tokens: int | None) -> str:
    return "-" if tokens is None else human_tokens(tokens)


class TransferPanel(VerticalScroll):
    """KV-cache copies in flight, then recent ones: hot prefix id, tokens copied, source > target, progress, size,
    rate, time, state (with the time left while running); details under the row (a narrow panel drops progress and
    rate and puts the state under the row too; the state of a running copy then shows its percentage)."""

    BORDER_TITLE = "3 Transfers"
    can_focus = True
    _last: FleetSnapshot | None = None

    def on_resize(self) -> None:
        if self._last is not None:  # the columns depend on the width
            self.update_snapshot(self._last)

    def compose(self) -> ComposeResult:
        yield Static(id="transfer-body")

    def update_snapshot(self, snap: FleetSnapshot) -> None:
        from rich.console import Group

        self._last = snap
        wide = self.size.width >= TRANSFERS_WIDE
        parts: list = [Text(_WIDE_HEAD if wide else _NARROW_HEAD, style="bold", no_wrap=True, overflow="ellipsis")]
        live = 0
        for x in snap.transfers:
            cs = CopyState(x.state)
            style = {CopyState.DONE: "green", CopyState.FAILED: "bold red", CopyState.STALLED: "yellow"}.get(cs, "cyan")
            if not cs.final:
                live += 1
            pct = f"{x.fraction * 100:3.0f}%"
            size = human_bytes(x.bytes_total) if x.bytes_total > 0 else "-"
            took = seconds(x.duration_s)
            route = f"{x.source}>{x.target}"
            pid, length = short_id(x.prefix_id), _copied(x.copied_tokens)
            if wide:
                rate = f"{human_bytes(x.bytes_per_s)}/s" if x.bytes_per_s else "-"
                row = f"{pid:12} {length:>4} {route:7} {bar(x.fraction, 8)} {pct} {size:>7} {rate:>9} {took:>6}  "
                state = x.state
            else:
                row = f"{pid:12} {length:>4} {route:5} {size:>6} {took:>5}"
                state = x.state if cs.final or cs is CopyState.STALLED else pct.strip()
            if x.outcome is not None and x.outcome != x.state:  # l3: proved, computed (not a copy), short
                state = x.outcome
            if not cs.final and x.eta_s is not None:
                state += f" {seconds(x.eta_s)} left"
            line = Text(row, no_wrap=True, overflow="ellipsis")
            if wide:
                line.append(state, style=style)
            parts.append(line)
            details = []
            if x.error:
                details.append(x.error)
            if x.usable_s is not None:  # from the detector's fire to a target that can serve the prefix
                usable = f"usable in {seconds(x.usable_s)}"
                if x.phases_s is not None and None not in x.phases_s:
                    src, moved, proof = x.phases_s
                    usable += f" (source {seconds(src)}, copy {seconds(moved)}, proof {seconds(proof)})"
                details.append(usable)
            if x.proof_storage_tokens is not None:  # an l3 copy's proof: tokens its target loaded from L3
                details.append(f"proof {human_tokens(x.proof_storage_tokens)} from L3")
            if details or not wide:
                more = Text("  ")
                if not wide:  # a narrow panel's state leads the line under the row
                    more.append(state, style=style)
                    if details:
                        more.append("; ")
                more.append("; ".join(details), style="dim")
                parts.append(more)
        body = Group(*parts) if snap.transfers else Text("no transfers yet", style="dim")
        self.query_one("#transfer-body", Static).update(body)
        self.border_subtitle = f"{live} in flight"


#: Colours and plotext markers of the TTFT lines (the head line is their legend).
TTFT_LINES = (("p50", "cyan", "braille"), ("p95", "magenta", "braille"))
#: The TTFT panel's x axis: ticks at these fractions of its window before now.
_X_TICKS = (1.0, 0.75, 0.5, 0.25, 0.0)


def ttft_runs(points, now_s: float, window_s: float) -> list[list]:
    """The TTFT points of the trailing ``window_s`` before ``now_s`` as runs of consecutive buckets with a first
    token (an empty bucket, NaN, ends a run: idle time is drawn as a gap, never a line across it)."""
    runs: list[list] = []
    cur: list = []
    for p in points:
        if p.t_s > now_s or p.t_s < now_s - window_s:
            continue
        if math.isnan(p.p50_s):
            if cur:
                runs.append(cur)
            cur = []
            continue
        cur.append(p)
    if cur:
        runs.append(cur)
    return runs


def ttft_unit(top_s: float) -> tuple[float, str]:
    """The y axis' unit for values up to ``top_s`` seconds: ``(1000, "ms")`` below a second, else ``(1, "s")``."""
    return (1000.0, "ms") if top_s < 1.0 else (1.0, "s")


class TtftPanel(Vertical):
    """TTFT over the last ``ttft_window_s`` (60 s) of fleet time (plotext): p50 and p95 per 1-second bucket, idle
    buckets as gaps; the y axis in ms or s, the x axis in seconds before the snapshot's ``now_s`` (never beyond
    it). The title line states the window with its p50/p95 (over every first token in it, not the latest bucket) and
    serves as the lines' legend (their colours); the bottom line says how many first tokens the window holds and the
    arrivals per second."""

    BORDER_TITLE = "4 TTFT"

    def compose(self) -> ComposeResult:
        from textual_plotext import PlotextPlot

        yield PlotextPlot(id="ttft-plot")

    def on_mount(self) -> None:
        plt = self.query_one("#ttft-plot").plt
        plt.theme("clear")
        # no top and right frame lines, no axis label: every row of a short panel goes to the lines
        plt.xaxes(True, False)
        plt.yaxes(True, False)

    def update_snapshot(self, snap: FleetSnapshot) -> None:
        from textual_plotext import PlotextPlot

        window = snap.ttft_window_s or TTFT_RECENT_WINDOW_S
        head = Text(f"{self.BORDER_TITLE} last {window:g}s")
        for name, colour, _ in TTFT_LINES:
            value = seconds(getattr(snap, f"ttft_{name}_s")) if snap.ttft_n else "-"
            head.append(f" {name} ", style=f"bold {colour}")
            head.append(value)
        self.border_title = head
        self.border_subtitle = f"{snap.ttft_n} first tokens in {window:g}s | {snap.rps:.0f} req/s"
        plot = self.query_one("#ttft-plot", PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        runs = ttft_runs(snap.ttft, snap.now_s, window)
        top = max((p.p95_s for run in runs for p in run), default=0.0)
        scale, unit = ttft_unit(top)
        for run in runs:
            xs = [p.t_s - snap.now_s for p in run]
            for name, colour, marker in TTFT_LINES:
                plt.plot(xs, [getattr(p, f"{name}_s") * scale for p in run], marker=marker, color=colour)
        plt.xlim(-window, 0.0)
        ticks = [-f * window for f in _X_TICKS]
        plt.xticks(ticks, [f"{t:g}s" if t else "now" for t in ticks])
        ytop = (top * scale * 1.1) if top > 0 else (100.0 if unit == "ms" else 1.0)
        plt.ylim(0.0, ytop)
        yt = [ytop * i / 4 for i in range(5)]
        plt.yticks(yt, [_y_label(v, unit) for v in yt])
        plot.refresh()


def _y_label(v: float, unit: str) -> str:
    if unit == "ms":
        return f"{v:.0f}ms"
    return f"{v:.1f}s" if v < 10 else f"{v:.0f}s"


class ConstantInput(Input):
    """One constant's field. Enter sends it; Escape leaves editing without sending (the field shows the value in
    force again and the focus returns to where it was before ``e``). Printable keys (``q``, ``e``, ...) are text
    while it has the focus."""

    BINDINGS = [
        Binding("escape", "leave", "leave editing"),
        Binding("enter", "submit", "send", show=True),
        Binding("tab", "app.focus_next", "next field", show=True),
    ]

    class Leave(Message):
        """Escape in a constant's field."""

    def action_leave(self) -> None:
        self.post_message(self.Leave())


class ConstantsPanel(Vertical):
    """BTB's four constants under their config and ``btbctl tune`` names (from :class:`BtbConstants`), editable
    (Enter sends a field, Escape leaves editing); the policy in the title and the fleet's last answer in the
    subtitle (``message``)."""

    BORDER_TITLE = "5 Constants"
    #: The fields in the order shown: the constants' own keys (``e`` focuses the first).
    FIELDS = BtbConstants.keys()

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.message = ""
        self.error = False

    def compose(self) -> ComposeResult:
        with Horizontal(id="const-row"):
            for key in self.FIELDS:
                yield Label(f"{key} ", classes="const-label")
                inp = ConstantInput(id=f"const-{key}", compact=True, classes="const-input", select_on_focus=True)
                inp.tooltip = constant_help(key)
                yield inp

    def field(self, key: str) -> ConstantInput:
        return self.query_one(f"#const-{key}", ConstantInput)

    def update_snapshot(self, snap: FleetSnapshot, force: bool = False) -> None:
        for key in self.FIELDS:
            inp = self.field(key)
            if key in snap.constants and (force or not inp.has_focus):
                val = str(snap.constants[key])
                if inp.value != val:
                    inp.value = val
        self.show_policy(snap.policy)

    def reset(self, constants: dict, key: str) -> None:
        """Show the value in force for ``key`` again (what Escape leaves)."""
        if key in constants:
            self.field(key).value = str(constants[key])

    def show_policy(self, policy: str) -> None:
        self.border_title = f"{self.BORDER_TITLE} | policy {policy or '-'}"

    def show(self, message: str, error: bool = False) -> None:
        self.message, self.error = message, error
        self.border_subtitle = Text(message, style="bold red" if error else "green")


def constant_help(key: str) -> str:
    """The description of a constant (its docstring in :class:`BtbConstants`) and its valid values."""
    desc = (BtbConstants.model_fields[key].description or "").replace("\n", " ")
    return f"{key}: {' '.join(desc.split())} Valid: {BtbConstants.describe(key)}."
