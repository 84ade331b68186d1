"""The operations dashboard: one Textual app over any :class:`~btbctl.engine.dashboard.DashboardSource`.

:func:`build_app` is the only way the app is made, by ``btbctl tui`` and by the tests alike.

Updates are pushed where the source can push them and pulled otherwise:

* a :class:`~btbctl.engine.dashboard.StreamingSource` (a fleet's control API, which follows the gateway's event
  stream) calls back with each new snapshot; the callback keeps only the latest one and posts one message until it
  is rendered, so however fast the fleet changes only the latest snapshot is rendered, and nothing is polled;
* otherwise, and while a streaming source's stream is down, a timer asks the source for a snapshot ``poll_hz``
  times a second in a Textual worker (so network calls and the simulation lock never run on the event loop); while
  one request is in flight the next tick is skipped.

The status line says which (``live: event stream`` or ``polling``) for a fleet. Pausing the view stops applying
snapshots (the fleet or simulation keeps running).
"""

from __future__ import annotations

import sys
from typing import Any

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Footer, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from btbctl.engine.chains import short_id
from btbctl.engine.constants import BtbConstants
from btbctl.engine.dashboard import DashboardSource, FleetSnapshot, StreamingSource
from btbctl.engine.errors import BtbctlError
from btbctl.tui.widgets.panels import (
    ConstantInput,
    ConstantsPanel,
    FleetPanel,
    PrefixPanel,
    TransferPanel,
    TtftPanel,
    constant_help,
)

#: Snapshot requests per second (4 Hz: a refresh rate a person reads comfortably; each costs one round of
#: control-API calls).
DEFAULT_POLL_HZ = 4.0

#: GIL switch interval while the dashboard runs, seconds (see :meth:`Dashboard.on_mount`).
GIL_SWITCH_S = 0.001

#: How the status line names a snapshot's feed (:attr:`~btbctl.engine.dashboard.FleetSnapshot.feed`).
FEED_LABELS = {"stream": "live: event stream", "poll": "polling"}

CSS = """
Screen { layout: vertical; }
#status { height: 1; background: $boost; padding: 0 1; }
#status.down { background: $error; color: $text; }
#status.paused { background: $warning; color: $text; }
#panels { layout: grid; grid-size: 2 2; grid-columns: 1fr 1fr; grid-rows: 4fr 3fr; height: 1fr; }
#panels > * { border: round $primary 50%; }
#panels > *:focus-within { border: round $accent; }
ConstantsPanel { height: 3; border: round $primary 50%; }
ConstantsPanel:focus-within { border: round $accent; }
#const-row { height: 1; }
.const-label { color: $text-muted; }
.const-input { width: 6; margin-right: 1; }
#p2, #p3, #prefix-table { scrollbar-size-vertical: 1; }
#prefix-table { height: 1fr; }
#prefix-empty { height: auto; }
#ttft-plot { height: 1fr; }
HelpScreen, ReplicateScreen, PolicyScreen { align: center middle; }
#dialog { width: 60; max-width: 95%; height: auto; max-height: 100%; border: thick $accent; background: $surface;
          padding: 0 1; }
#help-dialog { width: 100; max-width: 100%; height: auto; max-height: 100%; border: thick $accent;
               background: $surface; padding: 0 1; }
#dialog Input { margin: 1 0 0 0; }
#dialog OptionList { height: auto; max-height: 20; }
"""

KEYS = """\
[b]btbctl tui[/b]: prefix heat, fleet and HBM, transfers, TTFT, BTB's constants.

  [b]1..5[/b]    jump to a panel (prefixes, fleet, transfers, TTFT, constants)
  [b]tab[/b]     next panel (next field while editing)
  [b]up/down[/b] select a prefix in panel 1 (kept when the list re-sorts)
  [b]r[/b]       replicate the selected prefix to n more workers
  [b]w[/b]       prewarm: a prompt (text, or @FILE: text, chat or token
          ids) computed by one worker, then copied to n more
  [b]c[/b]       change the routing policy
  [b]e[/b]       edit the constants: [b]enter[/b] sends the field (the fleet
          confirms or refuses), [b]escape[/b] leaves editing and sends
          nothing; keys typed in a field are text
  [b]p[/b]       pause / resume the view (the fleet keeps running)
  [b]?[/b]       this help
  [b]q[/b]       quit
"""

LEGEND = """\
[b]1 Prefix heat[/b]: prefixes in the detector window, hottest first
  [b]prefix[/b]  prefix id, as [i]btbctl replicate --prefix[/i] takes it
  [b]len[/b]     prefix length, tokens (prefix_blocks blocks; k = 1024)
  [b]arr/X[/b]   arrivals in the last window_s seconds / threshold
          (red: hot, replication fired)
  [b]hold[/b]    workers holding the whole prefix in their KV cache
  [b]cp[/b]      copies of it in flight
  [b]trend[/b]   arrivals over the last snapshots
[b]2 Fleet / HBM[/b]
  [b]ok[/b]      health check: up or DOWN
  [b]run[/b]     requests running    [b]queue[/b] requests waiting
  [b]KV[/b]      KV cache held / capacity: █ running requests,
          ▓ cached prefixes (evictable), ░ free
  [b]via[/b]     (workers, wide panel) whose numbers these are:
{worker_sources}
  [b]HBM GB[/b]  GPU memory in use / size, GB (1e9 bytes, as in
          [i]btbctl presets[/i])
  [b]util[/b]    GPU utilisation
  [b]via[/b]     (GPUs) whose figures these are:
{gpu_sources}
[b]3 Transfers[/b]: KV-cache copies, in flight first
  [b]prefix[/b]  the hot prefix it is for (the id of panel 1)
  [b]len[/b]     tokens copied (a policy may copy a deeper chain)
  [b]route[/b]   source>target worker
  [b]size[/b]    bytes the copy moves (GB = 1e9 bytes)
  [b]rate[/b]    bytes per second
  [b]time[/b]    time since it started, or how long it took
  [b]state[/b]   and, while running, the time left; details below
[b]4 TTFT[/b]: time to first token over the last 60 s: the title's
  p50/p95 over every first token in it, the bottom line how many
  and the arrivals per second; the lines per 1 s bucket, gaps
  where no first token came; y: ms or s, x: seconds before now
[b]5 Constants[/b]: as named in the config's \\[btb] and by [i]btbctl tune[/i]
"""


def legend() -> str:
    """The panels' legend, with the sources of the fleet panel's figures from their one definition each."""
    import textwrap

    from btbctl.engine.dashboard import GPU_SOURCES
    from btbctl.tui.widgets.panels import SOURCE_LABELS

    def listing(items: dict[str, str]) -> str:
        pad = " " * 10
        return "\n".join(
            textwrap.fill(f"{k} ({v})", width=72, initial_indent=pad, subsequent_indent=pad + "  ")
            for k, v in items.items()
        )

    return LEGEND.format(worker_sources=listing(SOURCE_LABELS), gpu_sources=listing(GPU_SOURCES))


def help_text() -> str:
    """The help screen: keys, then the legend of every panel, then each constant from :class:`BtbConstants`."""
    import textwrap

    lines = []
    for k in BtbConstants.keys():
        text = textwrap.fill(constant_help(k), width=72, initial_indent="  ", subsequent_indent="          ")
        lines.append(escape_markup(text).replace(f"  {k}:", f"  [b]{k}[/b]:", 1))
    consts = "\n".join(lines)
    return f"{KEYS}\n{legend()}{consts}\n\n[dim]escape closes this screen[/dim]"


def escape_markup(text: str) -> str:
    from rich.markup import escape

    return escape(text)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-dialog"):
            yield Static(help_text())


class ReplicateScreen(ModalScreen[int | None]):
    """Asks how many more workers should get the prefix; dismisses with n, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, prefix_id: str, default_n: int) -> None:
        super().__init__()
        self.prefix_id = prefix_id
        self.default_n = default_n

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(f"Replicate prefix {short_id(self.prefix_id)} to how many more workers?")
            yield Input(str(self.default_n), id="replicate-n", type="integer")
            yield Label("", id="replicate-error")

    @on(Input.Submitted, "#replicate-n")
    def _submit(self, event: Input.Submitted) -> None:
        try:
            n = int(event.value)
        except ValueError:
            n = 0
        if n < 1:
            self.query_one("#replicate-error", Label).update("[red]n must be an integer >= 1[/red]")
            return
        self.dismiss(n)

    def action_cancel(self) -> None:
        self.dismiss(None)


class PrewarmScreen(ModalScreen[tuple[dict, int] | None]):
    """Asks for a prompt (text, or ``@FILE`` read as ``btbctl prewarm`` reads it) and how many more workers should
    get it; dismisses with ``(prompt, n)``, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, default_n: int) -> None:
        super().__init__()
        self.default_n = default_n

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Prewarm: the prompt (text, or @FILE), computed once, then copied to n more workers")
            yield Input("", id="prewarm-prompt", placeholder="text, or @path/to/prompt.json")
            yield Input(str(self.default_n), id="prewarm-n", type="integer")
            yield Label("", id="prewarm-error")

    @on(Input.Submitted)
    def _submit(self, event: Input.Submitted) -> None:
        from btbctl.engine.control.steering import read_prompt

        raw = self.query_one("#prewarm-prompt", Input).value
        try:
            n = int(self.query_one("#prewarm-n", Input).value)
        except ValueError:
            n = 0
        error = self.query_one("#prewarm-error", Label)
        if not raw.strip():
            error.update("[red]type a prompt, or @FILE[/red]")
            return
        if n < 1:
            error.update("[red]n must be an integer >= 1[/red]")
            return
        prompt = {"text": raw}
        if raw.startswith("@"):
            try:
                prompt = read_prompt(raw[1:].strip())
            except BtbctlError as e:
                error.update(Text(str(e), style="red"))
                return
        self.dismiss((prompt, n))

    def action_cancel(self) -> None:
        self.dismiss(None)


class PolicyScreen(ModalScreen[str | None]):
    """Pick a routing policy from the registry."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        from btbctl.engine.policies import POLICIES

        with Vertical(id="dialog"):
            yield Label(f"Routing policy (now {self.current}):")
            names = list(POLICIES)
            # whole summaries: the option list wraps them at word boundaries
            ol = OptionList(*[Option(policy_prompt(n, POLICIES[n].summary), id=n) for n in names], id="policy-list")
            if self.current in names:
                ol.highlighted = names.index(self.current)
            yield ol

    @on(OptionList.OptionSelected)
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


def policy_prompt(name: str, summary: str) -> Text:
    """A policy picker entry: the name, then its whole summary (dim), wrapped by the list at word boundaries."""
    text = Text(name, style="bold")
    if summary:
        text.append("  ")
        text.append(summary, style="dim")
    return text


class Dashboard(App):
    """The dashboard. Attributes tests read: ``snapshot`` (latest applied), ``applied`` (snapshots rendered),
    ``pushed`` (of those, pushed by a streaming source), ``skipped`` (ticks skipped because a request was still in
    flight), ``paused``."""

    TITLE = "btbctl"
    CSS = CSS
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("p", "pause", "pause"),
        Binding("r", "replicate", "replicate"),
        Binding("w", "prewarm", "prewarm"),
        Binding("c", "policy", "policy"),
        Binding("e", "edit", "edit"),
        Binding("1", "panel(1)", "prefixes", show=False),
        Binding("2", "panel(2)", "fleet", show=False),
        Binding("3", "panel(3)", "transfers", show=False),
        Binding("4", "panel(4)", "ttft", show=False),
        Binding("5", "panel(5)", "constants", show=False),
    ]

    class Applied(Message):
        """Posted after a snapshot was rendered."""

        def __init__(self, snapshot: FleetSnapshot) -> None:
            super().__init__()
            self.snapshot = snapshot

    class Pushed(Message):
        """A streaming source has a new snapshot (the latest is in ``Dashboard._pushed``; one message is posted
        until it is rendered)."""

    def __init__(self, source: DashboardSource, *, poll_hz: float = DEFAULT_POLL_HZ, title: str = "") -> None:
        super().__init__()
        self.source = source
        self.poll_interval_s = 1.0 / poll_hz
        self.snapshot: FleetSnapshot | None = None
        self.applied = 0
        self.skipped = 0
        self.paused = False
        self._in_flight = False
        self._was_connected: bool | None = None
        self._streams = isinstance(source, StreamingSource)
        self._pushed: FleetSnapshot | None = None
        self._push_posted = False
        self.pushed = 0
        self.sub_title = title
        self._before_edit: Widget | None = None

    # -- layout -----------------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static("connecting...", id="status")
        with Grid(id="panels"):
            yield PrefixPanel(id="p1")
            yield FleetPanel(id="p2")
            yield TransferPanel(id="p3")
            yield TtftPanel(id="p4")
        yield ConstantsPanel(id="p5")
        yield Footer()

    async def on_mount(self) -> None:
        # A simulation source replays in a thread of this process; a 1 ms GIL switch interval (Python's default is
        # 5 ms) lets the event loop answer a key within a few switches even while that thread is busy.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        if self._streams:
            self.source.set_listener(self._on_pushed)
        await self.source.start()
        self.set_interval(self.poll_interval_s, self._tick)
        self._tick()
        self._main("#prefix-table").focus()

    async def on_unmount(self) -> None:
        if self._streams:
            self.source.set_listener(None)
        await self.source.close()

    def _main(self, selector, expect_type=None):
        """A widget of the dashboard's own screen, also while a dialog (help, replicate, policy) is on top: the
        app's ``query_one`` searches only the active screen."""
        screen = self.screen_stack[0]
        return screen.query_one(selector) if expect_type is None else screen.query_one(selector, expect_type)

    # -- pushed snapshots -------------------------------------------------------------------------------------
    def _on_pushed(self, snap: FleetSnapshot) -> None:
        """The streaming source's callback (in this app's event loop): keep the latest, post one message."""
        self._pushed = snap
        if not self._push_posted:
            self._push_posted = True
            self.post_message(self.Pushed())

    def on_dashboard_pushed(self, message: Pushed) -> None:
        self._push_posted = False
        snap = self._pushed
        if snap is None or self.paused:  # kept for the resume
            return
        self._pushed = None
        self.pushed += 1
        self.apply_snapshot(snap)

    # -- polling ----------------------------------------------------------------------------------------------
    def _tick(self) -> None:
        if self.paused:
            return
        if self._streams and self.source.streaming:
            return  # the stream pushes snapshots: nothing to ask for
        if self._in_flight:
            self.skipped += 1
            return
        self._in_flight = True
        self._poll()

    @work(group="poll", exit_on_error=False)
    async def _poll(self) -> None:
        try:
            snap = await self.source.snapshot()
        except Exception as e:  # noqa: BLE001 - a source bug must not kill the screen; say it instead
            self._set_status(f"snapshot failed: {e}", "down")
            return
        finally:
            self._in_flight = False
        if self._streams and self.source.streaming:
            return  # the stream opened while this request ran: what it pushes is newer
        if not self.paused:
            self.apply_snapshot(snap)

    def apply_snapshot(self, snap: FleetSnapshot) -> None:
        """Render ``snap`` in every panel and the status line (not once the app shuts down: a snapshot pushed or
        polled just before can still be in its queue after the screens are gone)."""
        if not self.is_running:
            return
        first = self.snapshot is None
        self.snapshot = snap
        self._main(PrefixPanel).update_snapshot(snap)
        self._main(FleetPanel).update_snapshot(snap)
        self._main(TransferPanel).update_snapshot(snap)
        self._main(TtftPanel).update_snapshot(snap)
        self._main(ConstantsPanel).update_snapshot(snap, force=first)
        if snap.connected and self._was_connected is False:
            self.notify("reconnected to the fleet", title="fleet")
        self._show_status(snap)
        self._was_connected = snap.connected
        self.applied += 1
        self.post_message(self.Applied(snap))

    def _show_status(self, snap: FleetSnapshot | None) -> None:
        """The status line for ``snap``: its message, how it arrived, and DISCONNECTED when the source is down."""
        if snap is None:
            self._set_status("", "")
            return
        feed = f" | {FEED_LABELS[snap.feed]}" if snap.feed in FEED_LABELS else ""
        if snap.connected:
            self._set_status(snap.message + (" (trace finished)" if snap.finished else "") + feed, "")
        else:
            self._set_status(f"DISCONNECTED: {snap.message}{feed}", "down")

    def _set_status(self, text: str, cls: str) -> None:
        if not self.is_running:  # shutting down: the status line is gone
            return
        st = self._main("#status", Static)
        if self.paused:
            text, cls = f"PAUSED (p resumes) | {text}", "paused"
        st.update(text)
        st.set_classes(cls)

    # -- actions ----------------------------------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused and self._pushed is not None and not self._push_posted:
            self._push_posted = True
            self.post_message(self.Pushed())  # what the stream brought while paused
        self._show_status(self.snapshot)

    def action_panel(self, n: int) -> None:
        if n == 5:
            self.action_edit()
            return
        target = {1: "#prefix-table", 2: "#p2", 3: "#p3", 4: "#ttft-plot"}[n]
        self._main(target).focus()

    def action_edit(self) -> None:
        """Focus the first constant's field (as shown); Escape comes back to the widget focused now."""
        focused = self.focused
        if not isinstance(focused, ConstantInput):
            self._before_edit = focused
        self._main(ConstantsPanel).field(BtbConstants.keys()[0]).focus()

    @on(ConstantInput.Leave)
    def _leave_edit(self, event: ConstantInput.Leave) -> None:
        """Escape in a field: nothing is sent; the fields show the constants in force, the focus goes back."""
        panel = self._main(ConstantsPanel)
        back = self._before_edit
        self._before_edit = None
        if back is None or not back.is_attached or isinstance(back, ConstantInput):
            back = self._main("#prefix-table")
        back.focus()
        if self.snapshot is not None:
            panel.update_snapshot(self.snapshot, force=True)
        if not panel.error:
            panel.show("left editing; nothing sent")

    def action_replicate(self) -> None:
        row = self._main(PrefixPanel).selected
        if row is None:
            self.notify("no prefix selected", severity="warning")
            return
        m = int(self.snapshot.constants.get("warm_replicas", 2) if self.snapshot else 2)
        default_n = max(1, m - max(1, row.holders))

        def done(n: int | None) -> None:
            if n is not None:
                self._replicate(row.prefix_id, n)

        self.push_screen(ReplicateScreen(row.prefix_id, default_n), done)

    @work(group="action", exit_on_error=False)
    async def _replicate(self, prefix_id: str, n: int) -> None:
        try:
            res = await self.source.replicate(prefix_id, n)
        except BtbctlError as e:
            self.notify(str(e), title="replicate refused", severity="error")
            return
        self.notify(res.message, title="replicate")

    def action_prewarm(self) -> None:
        m = int(self.snapshot.constants.get("warm_replicas", 2) if self.snapshot else 2)

        def done(asked: tuple[dict, int] | None) -> None:
            if asked is not None:
                self._prewarm(*asked)

        self.push_screen(PrewarmScreen(max(1, m - 1)), done)

    @work(group="action", exit_on_error=False)
    async def _prewarm(self, prompt: dict, n: int) -> None:
        try:
            res = await self.source.prewarm(prompt, n)
        except BtbctlError as e:
            self.notify(str(e), title="prewarm refused", severity="error")
            return
        self.notify(res.message, title="prewarm")

    def action_policy(self) -> None:
        current = self.snapshot.policy if self.snapshot else ""

        def done(name: str | None) -> None:
            if name:
                self._set_policy(name)

        self.push_screen(PolicyScreen(current), done)

    @work(group="action", exit_on_error=False)
    async def _set_policy(self, name: str) -> None:
        panel = self._main(ConstantsPanel)
        try:
            confirmed = await self.source.set_policy(name)
        except BtbctlError as e:
            panel.show(f"policy refused: {e}", error=True)
            return
        panel.show(f"policy {confirmed} confirmed")
        panel.show_policy(confirmed)

    @on(Input.Submitted, ".const-input")
    def _constant_submitted(self, event: Input.Submitted) -> None:
        key = (event.input.id or "").removeprefix("const-")
        panel = self._main(ConstantsPanel)
        current = dict(self.snapshot.constants) if self.snapshot and self.snapshot.constants else {}
        try:  # validate here first, as the engine does: a bad value never leaves the screen
            value: Any = getattr(BtbConstants.parse({key: event.value}, from_text=True), key)
            BtbConstants.parse(current).with_updates(**{key: value})
        except BtbctlError as e:
            panel.show(str(e), error=True)
            return
        panel.show(f"sending {key} = {value} ...")
        self._send_constant(key, value)

    @work(group="action", exit_on_error=False)
    async def _send_constant(self, key: str, value: Any) -> None:
        panel = self._main(ConstantsPanel)
        try:
            confirmed = await self.source.set_constants(**{key: value})
        except BtbctlError as e:
            panel.show(f"refused: {e}", error=True)
            return
        if self.snapshot is not None:
            from dataclasses import replace

            self.snapshot = replace(self.snapshot, constants=dict(confirmed))
            panel.update_snapshot(self.snapshot, force=True)
        panel.show(f"{key} = {confirmed.get(key)} confirmed")


def build_app(source: DashboardSource, *, poll_hz: float = DEFAULT_POLL_HZ, title: str = "") -> Dashboard:
    """The dashboard over ``source`` (a :class:`~btbctl.engine.dashboard.sim_source.SimSource`,
    :class:`~btbctl.engine.dashboard.control_source.ControlApiSource` or anything with the same methods).

    Args:
        source: where snapshots come from and actions go to.
        poll_hz: snapshot requests per second (> 0; default :data:`DEFAULT_POLL_HZ`).
        title: shown in the terminal title.
    """
    if not poll_hz > 0:
        raise ValueError(f"poll_hz must be > 0, got {poll_hz!r}")
    return Dashboard(source, poll_hz=poll_hz, title=title)
