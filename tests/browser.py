"""Headless Chromium driven over the Chrome DevTools protocol (CDP): open a page, wait for it to
load, read what the browser saw (decoded images, console errors, network requests) and take a
screenshot. Debian's `chromium` package; the websocket client is `websocket-client`."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import websocket

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--remote-debugging-port=0",
)

# Every <img> after decoding: the browser's own verdict on each embedded picture.
IMAGES_JS = """
Promise.all(Array.from(document.images).map(img =>
    img.decode().then(() => null, err => String(err)).then(error => ({
        alt: img.alt, naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
        complete: img.complete, error: error, scheme: img.src.split(':')[0]}))))
"""


def executable() -> str | None:
    return next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )


@dataclass
class PageReport:
    """What the browser saw: one dict per <img>, console/log errors, every URL it requested."""

    images: list
    errors: list
    requests: list
    title: str
    height: int
    screenshot: bytes = field(repr=False)


class Chromium:
    """A headless Chromium process with one page, driven over its DevTools websocket."""

    def __init__(self, timeout: float = 60.0):
        exe = executable()
        if exe is None:
            raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="ntk-chromium-")
        self.process = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port = self._port()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as r:
                targets = json.load(r)
            url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            self.ws = websocket.create_connection(url, timeout=timeout, suppress_origin=True)
        except BaseException:
            self.close()
            raise
        self.events: list[dict] = []
        self._id = 0

    def _port(self) -> int:
        """Chromium writes the port it chose (--remote-debugging-port=0) to DevToolsActivePort."""
        file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.process.returncode}")
            if file.is_file() and (lines := file.read_text().split()):
                return int(lines[0])
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def send(self, method: str, **params) -> dict:
        """Call a CDP method and return its result; events arriving meanwhile are kept."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def wait_for(self, event: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for message in self.events:
                if message.get("method") == event:
                    return message
            self.events.append(json.loads(self.ws.recv()))
        raise TimeoutError(f"no {event} within {self.timeout} s")

    def inspect(
        self, url: str, *, width: int = 1200, height: int = 900, full_page: bool = True
    ) -> PageReport:
        """Load `url`, wait for the load event and for every image to decode, then report."""
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.events.clear()
        self.send("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")
        images = self.send(
            "Runtime.evaluate", expression=IMAGES_JS, awaitPromise=True, returnByValue=True
        )["result"]["value"]
        title = self.send("Runtime.evaluate", expression="document.title", returnByValue=True)[
            "result"
        ]["value"]
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {
            "x": 0,
            "y": 0,
            "width": width,
            "height": size["height"] if full_page else height,
            "scale": 1,
        }
        shot = self.send(
            "Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=full_page
        )
        return PageReport(
            images=images,
            errors=self._errors(),
            requests=self._requests(),
            title=title,
            height=int(size["height"]),
            screenshot=base64.b64decode(shot["data"]),
        )

    def _errors(self) -> list:
        errors = []
        for message in self.events:
            method, params = message.get("method"), message.get("params", {})
            if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                errors.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
                )
            elif method == "Runtime.exceptionThrown":
                errors.append(params["exceptionDetails"].get("text", "exception"))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                errors.append(params["entry"]["text"])
            elif method == "Network.loadingFailed":
                errors.append(f"failed to load: {params.get('errorText')}")
        return errors

    def _requests(self) -> list:
        return [
            m["params"]["request"]["url"]
            for m in self.events
            if m.get("method") == "Network.requestWillBeSent"
        ]

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                self.send("Browser.close")
            except Exception:
                pass
            ws.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
