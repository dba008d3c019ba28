"""A real Prometheus server for the tests: Debian's `prometheus` package, started on a free port with
Ray's service-discovery file as its targets (what a Prometheus next to a Ray cluster reads), queried
over its HTTP API. Stopped by its pid."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from .conftest import free_port

MISSING = "no prometheus binary: install Debian's package (apt-get install prometheus) to run this test"


def available() -> bool:
    return shutil.which("prometheus") is not None


class Prometheus:
    def __init__(self, sd_file: Path, tmp: Path, scrape_s: float = 1.0):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = tmp / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {scrape_s:g}s\n  evaluation_interval: {scrape_s:g}s\n"
            "scrape_configs:\n  - job_name: ray\n    file_sd_configs:\n"
            f"      - files: ['{sd_file}']\n        refresh_interval: 2s\n"
        )
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                "prometheus", f"--config.file={config}", f"--web.listen-address={self.url[7:]}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
            ],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/-/ready", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("prometheus did not start:\n" + self.log.read_text()[-3000:]) from None
                time.sleep(0.3)

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` gives now (an error from Prometheus raises, with its message)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{expr}: {e.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets_up(self) -> int:
        return sum(float(r["value"][1]) == 1 for r in self.query('up{job="ray"}'))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
