"""A `nanoengine serve` subprocess on a free loopback port, for the server's tests (test_serve.py,
test_serve_abuse.py): started and read here, stopped by SIGINT."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import httpx
import openai

MODEL = "tiny-qwen3"
ENGINE = ["--dtype", "float32", "--num-kvcache-blocks", "512", "--max-model-len", "1024"]
START_TIMEOUT_S = 180  # loading tiny-qwen3 takes ~3 s idle, far more on a busy 2-core machine


class Server:
    """`nanoengine serve` in a subprocess on a port the OS picks (read from its first line)."""

    def __init__(self, *extra: str, env: dict[str, str] | None = None, model: str = MODEL,
                 engine_flags: tuple[str, ...] | list[str] = tuple(ENGINE)) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoengine", "serve", model, "--port", "0",
                                      "--log-level", "warning", *engine_flags, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        line, deadline = "", time.monotonic() + START_TIMEOUT_S
        while "/v1" not in line:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            if not ready or (not line and self.proc.poll() is not None):
                self.stop()
                raise RuntimeError(f"the server did not start: {line!r}")
        self.url = re.search(r"(http://\S+)/v1", line).group(1)
        while httpx.get(f"{self.url}/health").status_code != 200:
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels folded into the name)."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
