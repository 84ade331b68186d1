"""Where the CLI and the dashboard find a running fleet's control API: the URL and the bearer token ``btbctl up``
recorded in the run directory, or given by hand. The client itself is :mod:`btbctl.engine.control.client`."""

from __future__ import annotations

from btbctl.engine.control.client import ControlClient, check_base_url
from btbctl.engine.errors import BtbctlError
from btbctl.engine.fileio import read_text_bounded
from btbctl.engine.launcher.rundir import RunDir


def resolve_control_api(
    *,
    url: str | None = None,
    token: str | None = None,
    token_file: str | None = None,
    run_dir: str | None = None,
    need_token: bool = False,
) -> tuple[str, str | None]:
    """The control-API base URL and bearer token to use: ``url`` or the one recorded by ``btbctl up`` in the run
    directory; ``token``, else the content of ``token_file``, else the run directory's ``control.token`` (None when
    there is none and ``need_token`` is false: reads work, writes will be refused).

    Raises:
        BtbctlError: no ``url`` and no running fleet recorded; an ``url`` that is not http(s); an unreadable
            ``token_file``; no token in the run directory while ``need_token``.
    """
    rd = RunDir(run_dir)
    if url is None:
        state = rd.live_state()
        if not state.control_url:
            raise BtbctlError(f"the fleet recorded in {rd.path} has no control API yet (still starting?)")
        url = state.control_url
    url = check_base_url(url)
    if token is None and token_file is not None:
        try:
            token = read_text_bounded(token_file).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise BtbctlError(f"cannot read the token file {token_file}: {getattr(e, 'strerror', None) or e}") from None
    if token is None:
        try:
            token = rd.read_token()
        except BtbctlError:
            if need_token:
                raise
            token = None
    return url, token


def client_for_run(run_dir: str | None = None, url: str | None = None, token: bool = True) -> ControlClient:
    """A synchronous client of the control API recorded in the run directory (or at ``url``), with the run's token
    (required when ``token`` is true, else sent only when there is one). Close it (``with client_for_run(...) as
    api:``).

    Raises:
        BtbctlError: no running fleet recorded, or no token while ``token``.
    """
    base, tok = resolve_control_api(url=url, run_dir=run_dir, need_token=token)
    return ControlClient(base, tok)


__all__ = ["client_for_run", "resolve_control_api"]
