"""`specav serve` as a process: flags checked before models load, and the estimator's state across restarts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from specav.cli import main
from specav.server import estimator_state
from tests.tiny_models import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,fragment", [
    (["--speculative-config", '{"num_speculative_tokens": 4'], "speculative_config is not valid JSON"),
    (["--speculative-config", '{"num_tokens": 4}'], "speculative_config: unknown key(s) ['num_tokens']"),
    (["--speculative-config", '{"num_speculative_tokens": 0}'], "speculative_config.num_speculative_tokens = 0"),
    (["--port", "70000"], "server.port = 70000 is invalid"),
    (["--max-queued-requests", "-1"], "server.max_queued_requests = -1"),
    (["--no-speculation", "--estimator-state", "x.pt"], "--estimator-state needs speculative decoding"),
    (["/some/model", "--model", "/other/model"], "the model is given twice"),
])
def test_bad_flags_exit_2_with_one_line_before_any_model_loads(argv, fragment, capsys, monkeypatch):
    import specav.engine.engine as engine_module

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(engine_module.Engine, "from_config", no_load)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specav serve: error:") and fragment in err and "\n" not in err and "Traceback" not in err


def test_a_state_file_of_another_k_is_refused_before_models_load(tmp_path, capsys, monkeypatch):
    import specav.engine.engine as engine_module

    monkeypatch.setattr(engine_module.Engine, "from_config", lambda *a, **k: pytest.fail("a model was loaded"))

    class Fake:
        def state_dict(self):
            return {"num_slots": 2}

    path = tmp_path / "state.pt"
    estimator_state.save(path, Fake(), estimator_state.identity("default", "default", 2))
    assert main(["serve", "--estimator-state", str(path)]) == 2
    err = capsys.readouterr().err
    assert "was learned for target 'default', drafter 'default', K = 2" in err and "K = 8" in err  # the packaged default


def test_state_is_saved_atomically_and_refused_when_it_belongs_to_another_pair(tmp_path):
    class Fake:
        def __init__(self):
            self.loaded = None

        def state_dict(self):
            return {"num_slots": 3, "slope": torch.tensor(0.5)}

        def load_state_dict(self, state):
            self.loaded = state

    ident = estimator_state.identity(str(tmp_path / "t"), str(tmp_path / "d"), 3)
    path = estimator_state.save(tmp_path / "s" / "state.pt", Fake(), ident)
    assert [p.name for p in path.parent.iterdir()] == ["state.pt"]  # no temporary file left behind
    fake = Fake()
    assert estimator_state.load(path, fake, ident) and float(fake.loaded["slope"]) == 0.5
    assert not estimator_state.load(tmp_path / "missing.pt", fake, ident)
    other = estimator_state.identity(str(tmp_path / "t"), str(tmp_path / "other"), 3)
    with pytest.raises(estimator_state.EstimatorStateError, match="was learned for .* but this server runs"):
        estimator_state.load(path, fake, other)
    (tmp_path / "junk.pt").write_bytes(b"not a state")
    with pytest.raises(estimator_state.EstimatorStateError, match="is not a specav estimator state"):
        estimator_state.load(tmp_path / "junk.pt", fake, ident)


# ---- a real process, stopped by signals -------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, target: str, drafter: str, state: Path, k: int = 3) -> None:
        self.port = free_port()
        spec = json.dumps({"model": drafter, "num_speculative_tokens": k})
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specav.cli", "serve", target, "--speculative-config", spec, "--dtype", "fp32",
             "--threads", "1", "--port", str(self.port), "--estimator-state", str(state), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"specav serve exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("specav serve did not become ready")

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def metric(self, name: str) -> float:
        line = next(line for line in httpx.get(f"{self.url}/metrics").text.splitlines() if line.startswith(name + " "))
        return float(line.split()[1])

    def complete(self, n: int) -> None:
        for i in range(n):
            body = {"prompt": [3 + i, 4, 5], "max_tokens": 24, "temperature": 0.8, "seed": i}
            assert httpx.post(f"{self.url}/v1/completions", json=body, timeout=60).status_code == 200


def test_the_estimator_state_survives_a_restart(tmp_path):
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    drafter = save_tiny_checkpoint(tmp_path / "drafter", seed=0)
    state = tmp_path / "estimator.pt"

    first = ServeProcess(target, drafter, state)
    first.wait_ready()
    first.complete(4)
    observed = first.metric("specav_estimator_observed_steps")
    assert observed > 0
    assert first.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    saved = torch.load(state, weights_only=True)
    assert saved["identity"] == estimator_state.identity(target, drafter, 3)
    assert saved["state"]["total_steps"] == observed

    second = ServeProcess(target, drafter, state)
    second.wait_ready()
    assert second.metric("specav_estimator_observed_steps") == observed  # restored, not started afresh
    assert second.metric("specav_estimator_slope") == pytest.approx(float(saved["state"]["slope"]))
    second.complete(2)
    assert second.stop(signal.SIGINT) == 0
    assert torch.load(state, weights_only=True)["state"]["total_steps"] > observed

    other_k = ServeProcess(target, drafter, state, k=2)
    assert other_k.proc.wait(120) == 2
    assert "K = 3" in other_k.proc.stderr.read()
