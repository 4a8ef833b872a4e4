"""http(s):// adapter archives: downloaded within the byte budget, every redirect checked (at most MAX_REDIRECTS)."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from loraplane_server.store.sources.archive import extract_adapter
from loraplane_server.store.sources.base import AdapterSourceError, Source, transient_status
from loraplane_server.store.sources.budget import Limits, copy_stream
from loraplane_server.store.sources.parse import archive_suffix, canonical_http, is_allowed

MAX_REDIRECTS = 5


def fetch_http(source: Source, dest: Path, limits: Limits) -> None:
    assert source.url is not None
    archive = dest / f".download{archive_suffix(urlsplit(source.url).path)}"
    try:
        _download(source.url, archive, limits)
        extract_adapter(archive, dest, limits.budget, source.uri)
    finally:
        for leftover in dest.glob(".download*"):
            leftover.unlink()


class _SafeRedirect(urllib.request.HTTPRedirectHandler):
    """Follows at most MAX_REDIRECTS redirects, to http(s) only, never from https down to http, and, given
    an allowlist, only to URLs it admits: the rule that admitted a source binds every hop of its download."""

    def __init__(self, allow: tuple[str, ...] | None) -> None:
        super().__init__()
        self.allow = allow
        self.num_redirects = 0

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN202
        self.check_hop(req.full_url, newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)

    def check_hop(self, old: str, new: str) -> None:
        self.num_redirects += 1
        if self.num_redirects > MAX_REDIRECTS:
            raise AdapterSourceError(
                f"{old} redirected more than {MAX_REDIRECTS} times (next to {new})",
                public=f"the adapter source redirected more than {MAX_REDIRECTS} times",
            )
        old_scheme, new_scheme = urlsplit(old).scheme, urlsplit(new).scheme
        if new_scheme not in ("http", "https") or (old_scheme == "https" and new_scheme != "https"):
            raise AdapterSourceError(
                f"refusing the redirect from {old} to {new}: only http(s), never from https to http",
                public="the adapter source redirected to a URL that is not http(s), or from https to http",
            )
        if self.allow is not None and not _is_allowed_url(new, self.allow):
            raise AdapterSourceError(
                f"refusing the redirect from {old} to {new}: every redirect must stay within "
                f"--adapter-source-allow ({', '.join(self.allow)})",
                public="the adapter source redirected outside the allowed sources; every redirect must stay "
                "within --adapter-source-allow",
            )


def _is_allowed_url(url: str, allow: tuple[str, ...]) -> bool:
    """Whether the allowlist admits an http(s) URL; a redirect target need not name an archive."""
    try:
        canonical = canonical_http(url)
    except AdapterSourceError:
        return False
    return is_allowed(Source(kind="http", uri=canonical, url=canonical), list(allow))


def _download(url: str, dest: Path, limits: Limits) -> None:
    opener = urllib.request.build_opener(_SafeRedirect(limits.allow))
    request = urllib.request.Request(url, headers={"User-Agent": "loraplane"})
    budget = limits.budget
    try:
        with opener.open(request, timeout=limits.timeout_s) as resp:
            length = resp.headers.get("Content-Length", "")
            if length.isdigit():  # refused before reading a byte; the body is counted as it is written
                budget.check(int(length), f"{url} is {length} bytes, more than the {budget.left} allowed")
            copy_stream(resp, dest, budget, url)
    except urllib.error.HTTPError as exc:
        raise AdapterSourceError(
            f"cannot download {url}: HTTP {exc.code} {exc.reason}", transient=transient_status(exc.code)
        ) from exc
    except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as exc:
        raise AdapterSourceError(f"cannot download {url}: {type(exc).__name__}: {exc}", transient=True) from exc
