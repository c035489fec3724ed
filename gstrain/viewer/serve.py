"""`gstrain view RUN`: serve a trained run's page until Ctrl-C."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import logging
import signal
import socket
import time
from pathlib import Path

from gstrain.errors import UserError


def check_host(host: str, key: str = "--host") -> str | None:
    """A user error for an empty address (the server would listen on every interface); for an
    address other machines can reach, the one-line warning to show (None for loopback)."""
    if not host.strip():
        raise UserError(f"{key} is empty; give an address to listen on (127.0.0.1: this machine only, "
                        "0.0.0.0: every interface)")
    if _is_loopback(host):
        return None
    return (f"gstrain: warning: {key} {host} is not a loopback address: other machines that reach it "
            "can open this page (and see the run)")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: loopback when every address it resolves to is
        try:
            found = socket.getaddrinfo(host, None)
        except OSError:
            return False  # the bind says what is wrong with it
        return bool(found) and all(ipaddress.ip_address(a[4][0].split("%")[0]).is_loopback for a in found)


def page_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def check_port(host: str, port: int) -> None:
    """A user error if host:port cannot be bound (viser would silently move to the next port)."""
    if not 0 < port < 65536:
        raise UserError(f"--port must be 1..65535; got {port}")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            # as the server will (asyncio does on Unix): connections in TIME_WAIT do not block it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def start_server(host: str, port: int, log=None, key: str = "--host"):
    """A viser server on exactly host:port, without viser's own banner; `key` names the host
    setting in messages, and `log` gets the warning when other machines can reach the page."""
    warning = check_host(host, key)
    check_port(host, port)
    if warning is not None and log is not None:
        log(warning)
    import viser

    # a stray non-HTTP connection (a port probe) is not worth a traceback on the user's terminal
    logging.getLogger("websockets").setLevel(logging.CRITICAL)

    with contextlib.redirect_stdout(io.StringIO()):
        server = viser.ViserServer(host=host, port=port, verbose=False)
    if server.get_port() != port:  # taken between our check and viser's bind
        server.stop()
        raise UserError(f"cannot listen on {host}:{port}: address already in use")
    return server


def stop_quietly(server) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        server.stop()
        time.sleep(0.2)  # viser's thread prints "Server stopped" as it ends


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve_run(run: Path, host: str = "127.0.0.1", port: int = 8080, log=print) -> None:
    """Serve the run's page and block until Ctrl-C (then stop the server and return)."""
    from gstrain.render import resolve_device
    from gstrain.train.appearance import render_protocol
    from gstrain.viewer.page import ViewerPage, config_summary
    from gstrain.viewer.run_info import load_run_info

    check_host(host)  # bad input before the run is read
    info = load_run_info(run, log=log)
    if len(info.params["means"]) == 0:  # an empty page would look like a viewer fault
        raise UserError(f"nothing to show: the checkpoint of {run} (step {info.step}) holds 0 Gaussians")
    server = start_server(host, port, log=log)
    try:
        page = ViewerPage(server, info.cfg, info.scene, resolve_device("auto"))
        page.set_splats(info.params)
        psnr = f"{info.test_psnr:.2f} dB" if info.test_psnr is not None else "n/a (no test evaluation)"
        lines = [f"**{run.name}**", config_summary(info.cfg), f"step {info.step}",
                 f"{len(info.params['means'])} Gaussians", f"test PSNR {psnr} (raw render)",
                 render_protocol(info.cfg)]
        page.set_info(lines + ([info.note] if info.note else []))
        log(f"gstrain: serving {run} at {page_url(host, port)} (Ctrl-C to stop); {render_protocol(info.cfg)}")
        for sig in (signal.SIGINT, signal.SIGTERM):  # a plain `kill` stops it as cleanly as Ctrl-C
            signal.signal(sig, _interrupt)
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        log("gstrain: viewer stopped")
    finally:
        stop_quietly(server)
