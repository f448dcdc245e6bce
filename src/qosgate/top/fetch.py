"""``qosgate top``'s fetch loop: every gateway's ``/v1/qos/status`` and ``/metrics`` scraped in
parallel (``Fetcher``), and the frames ``view.frame`` builds from them printed one after another or
kept live on a terminal (``run``)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rich.console import Console

from qosgate.top.view import Samples, Scrape, frame, get_in, parse_metrics


def normalize_url(url: str) -> str:
    """``host:port`` or a full base URL -> ``http://host:port`` (no trailing slash)."""
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def _metrics_url(base: str, metrics_port: int | None) -> str:
    if metrics_port is None:
        return base + "/metrics"
    p = urlsplit(base)
    return urlunsplit((p.scheme, f"{p.hostname}:{metrics_port}", "/metrics", "", ""))


def _why(exc: BaseException, timeout: float) -> str:
    """A one-line reason an operator can act on, not a traceback."""
    if isinstance(exc, urllib.error.HTTPError):
        msg = ""
        with contextlib.suppress(Exception):
            msg = str(json.loads(exc.read())["error"]["message"])
        hint = " (check --key / QOSGATE_ADMIN_KEY)" if exc.code in (401, 403) else ""
        return f"HTTP {exc.code}{': ' + msg if msg else ''}{hint}"
    if isinstance(exc, urllib.error.URLError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"no answer within {timeout:g}s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({exc.strerror})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _get_url(url: str, key: str | None, timeout: float) -> bytes:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body: bytes = r.read()
        return body


class Fetcher:
    """Scrapes every URL's status and metrics in parallel, each call with its own timeout."""

    def __init__(self, urls: list[str], key: str | None, timeout: float,
                 metrics_port: int | None = None) -> None:
        self.urls = [normalize_url(u) for u in urls]
        self.key = key
        self.timeout = timeout
        self.metrics_port = metrics_port
        self.pool = ThreadPoolExecutor(max_workers=min(32, len(self.urls)))

    def _status(self, url: str) -> tuple[dict[str, Any] | None, str | None]:
        try:
            out = json.loads(_get_url(url + "/v1/qos/status", self.key, self.timeout))
        except Exception as exc:
            return None, _why(exc, self.timeout)
        if not isinstance(out, dict):
            return None, "not a qosgate status"
        return out, None

    def _metrics(self, url: str) -> tuple[Samples | None, str | None]:
        try:
            text = _get_url(_metrics_url(url, self.metrics_port), self.key, self.timeout)
            return parse_metrics(text.decode()), None
        except Exception as exc:
            return None, _why(exc, self.timeout)

    def _one(self, url: str, at: float, want: str | None = None, tries: int = 16
             ) -> Scrape | None:
        """Status and metrics of one worker behind ``url``: ``want``, or whichever answers.
        Each connection may reach another worker of a port that several share (the kernel
        spreads them), so ask again, a new connection each time, up to ``tries`` times for the
        status of ``want`` and for the metrics of the worker whose status we have. None if
        ``want`` never answered."""
        for _ in range(tries):
            status, serr = self._status(url)
            if want is None or (status is not None and status.get("instance") == want):
                break
        else:
            return None
        metrics, merr = self._metrics(url)
        sc = Scrape(url, at, status, serr, metrics, merr)
        for _ in range(tries - 1):
            if status is None or sc.metrics is None or sc.instance == status.get("instance"):
                break
            sc.metrics, sc.metrics_error = self._metrics(url)
        return sc

    def _url(self, url: str, at: float) -> list[Scrape]:
        """Every worker behind ``url``: with ``--workers`` and Redis the status lists the fleet,
        and new connections reach the workers the first one was not. Only the answering
        instance's siblings (``<id>-w<i>``) are looked for: other gateways that share the Redis
        are not behind this URL."""
        first = self._one(url, at)
        assert first is not None  # want=None: the first answer, whatever it is
        me = get_in(first.status, "instance")
        if not isinstance(me, str) or first.instance != me:
            return [first]
        sibling = re.compile(re.escape(re.sub(r"-w\d+$", "", me)) + r"-w\d+")
        if not sibling.fullmatch(me):
            return [first]
        fleet = sorted(i for i in get_in(first.status, "shared_state", "fleet") or {}
                       if i != me and sibling.fullmatch(i))
        got = {me: first}
        for inst in fleet:  # a worker that did not answer is left out of this frame
            sc = self._one(url, at, want=inst, tries=max(16, 4 * (len(fleet) + 1)))
            if sc is not None and sc.instance == inst:
                got[inst] = sc
        return [got[k] for k in sorted(got)]

    def scrape(self) -> list[Scrape]:
        at = time.monotonic()
        futures = [self.pool.submit(self._url, u, at) for u in self.urls]
        return [sc for f in futures for sc in f.result()]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def run(urls: list[str], key: str | None, interval: float = 1.0, timeout: float = 2.0,
        once: bool = False, width: int | None = None, metrics_port: int | None = None) -> int:
    """The command: 0 once stopped (Ctrl-C) or after ``--once`` if a gateway answered, else 1."""
    tty = sys.stdout.isatty()
    console = Console(width=width if width or tty else 120, highlight=False,
                      no_color=not tty, force_terminal=tty if tty else None)
    fetcher = Fetcher(urls, key, timeout, metrics_port)
    try:
        if once or not tty:
            return _print_frames(fetcher, console, interval, once)
        return _live(fetcher, console, interval)
    finally:
        fetcher.close()


def _no_answer(scrapes: list[Scrape]) -> str:
    return "qosgate top: no gateway answered: " + "; ".join(
        f"{s.url}: {s.status_error}" for s in scrapes)


def _print_frames(fetcher: Fetcher, console: Console, interval: float, once: bool) -> int:
    """Plain frames one after another (``--once``, or stdout not a terminal: a log)."""
    previous: dict[str, Scrape] = {}
    try:
        while True:
            t0 = time.monotonic()
            scrapes = fetcher.scrape()
            if console.is_terminal:
                console.print(frame(scrapes, previous))
            else:  # a file or a pipe: no trailing padding for scripts to strip
                with console.capture() as cap:
                    console.print(frame(scrapes, previous))
                print("\n".join(ln.rstrip() for ln in cap.get().splitlines()), flush=True)
            if once:
                if not any(s.answered for s in scrapes):
                    print(_no_answer(scrapes), file=sys.stderr)
                    return 1
                return 0
            print(flush=True)
            previous.update({s.key: s for s in scrapes if s.metrics is not None})
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return 0


def _live(fetcher: Fetcher, console: Console, interval: float) -> int:
    from rich.live import Live

    previous: dict[str, Scrape] = {}
    try:
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                t0 = time.monotonic()
                scrapes = fetcher.scrape()
                live.update(frame(scrapes, previous), refresh=True)
                previous.update({s.key: s for s in scrapes if s.metrics is not None})
                time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return 0
